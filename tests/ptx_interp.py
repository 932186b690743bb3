"""A small interpreter of the inline PTX that the decode kernels embed (``kernels.linear_mma``:
``DECODE_ASM``, ``scale_asm``), on int64 tensors of 32-bit register values, so that tests can run
the asm's arithmetic on CPU over many words at once (test_decode_asm.py, test_mma_layout.py).

It knows the instructions in ``INSTRUCTIONS`` and fails on any other: an instruction added to the
asm must be taught here (with its PTX semantics) before the tests can pass.
"""

from __future__ import annotations

import re

import torch

M32 = 0xFFFFFFFF
INSTRUCTIONS = frozenset({"mov.b32", "shr.u32", "shl.b32", "shf.l.wrap.b32", "and.b32", "lop3.b32", "mul.lo.u32",
                          "mad.lo.u32", "cvt.u32.u16", "prmt.b32", "fma.rn.bf16x2"})


def _lop3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, lut: int) -> torch.Tensor:
    """lop3.b32: each result bit is bit (4 a + 2 b + c) of ``lut`` (a = 0xF0, b = 0xCC, c = 0xAA)."""
    out = torch.zeros_like(a)
    for i in range(8):
        if lut >> i & 1:
            out |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
    return out & M32


def instructions_of(asm: str) -> set[str]:
    """The instruction names used by ``asm``."""
    return {s.split()[0] for s in asm.replace("{", " ").replace("}", " ").split(";")
            if s.strip() and not s.strip().startswith(".reg")}


def bf16_to_float(bits: torch.Tensor) -> torch.Tensor:
    """fp32 values of the bf16 bit patterns in the low 16 bits of ``bits``."""
    t = (bits & 0xFFFF) << 16
    return torch.where(t >= 2**31, t - 2**32, t).to(torch.int32).view(torch.float32)


def float_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns (int64) of fp32 ``x``, rounded to nearest even."""
    return x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def _prmt(a: torch.Tensor, b: torch.Tensor, sel: int) -> torch.Tensor:
    """prmt.b32 default mode: byte i of the result is byte (selector nibble i & 7) of {b, a}, or that
    byte's sign replicated when the nibble's bit 3 is set."""
    out = torch.zeros_like(a)
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        src = a if (s & 7) < 4 else b
        byte = (src >> (8 * (s & 3))) & 0xFF
        if s & 8:
            byte = torch.where(byte & 0x80 != 0, 0xFF, 0)
        out |= byte << (8 * i)
    return out


def run_ptx(asm: str, operands: list, n_out: int) -> list[torch.Tensor]:
    """Interpret ``asm``; ``operands`` are the inputs $n_out.. in order (tensors or ints, broadcast
    together); returns $0..$(n_out - 1) as int64 tensors."""
    regs: dict[str, torch.Tensor] = {f"${n_out + i}": torch.as_tensor(v, dtype=torch.int64) & M32
                                     for i, v in enumerate(operands)}

    def val(tok: str) -> torch.Tensor:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return torch.tensor(int(tok, 0) & M32, dtype=torch.int64)

    for stmt in asm.replace("{\n", "\n").split(";"):
        stmt = stmt.strip().strip("{}").strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if op not in INSTRUCTIONS:  # the asm grew an instruction: teach it here before trusting the tests
            raise AssertionError(f"the PTX interpreter does not know {op!r}")
        if op == "mov.b32" and rest.startswith("{"):  # unpack: {lo, hi}, src
            lo, hi, src = re.match(r"\{\s*(\S+)\s*,\s*(\S+)\s*\}\s*,\s*(\S+)", rest).groups()
            v = val(src)
            regs[lo], regs[hi] = v & 0xFFFF, v >> 16
            continue
        dst, *args = [t.strip() for t in rest.split(",")]
        a = [val(t) for t in args]
        if op == "mov.b32":
            r = a[0]
        elif op == "shr.u32":
            r = a[0] >> a[1]
        elif op == "shl.b32":  # shift counts above 31 clamp to 32 (the result is 0)
            r = a[0] << torch.clamp(a[1], max=32)
        elif op == "shf.l.wrap.b32":  # the high word of {a[1]:a[0]} << (n mod 32)
            n = a[2] & 31
            r = (a[1] << n) | (a[0] >> (32 - n))  # n = 0: a[0] >> 32 is 0 (a[0] < 2**32)
        elif op == "lop3.b32":
            r = _lop3(a[0], a[1], a[2], int(a[3]))
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "mul.lo.u32":
            r = a[0] * a[1]
        elif op == "mad.lo.u32":
            r = a[0] * a[1] + a[2]
        elif op == "cvt.u32.u16":
            r = a[0] & 0xFFFF
        elif op == "prmt.b32":
            r = _prmt(a[0], a[1], int(a[2]))
        else:  # fma.rn.bf16x2, per half; the products here are exact in fp32
            r = sum(float_to_bf16(bf16_to_float(a[0] >> h) * bf16_to_float(a[1] >> h) + bf16_to_float(a[2] >> h)) << h
                    for h in (0, 16))
        regs[dst] = r & M32
    return [regs[f"${i}"] for i in range(n_out)]
