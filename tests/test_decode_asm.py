"""The decode kernels' inline PTX (``kernels.linear_mma``: ``DECODE_ASM``, ``scale_asm``), run
instruction by instruction on CPU by a small interpreter of the instructions it uses, for every
E2M1 code in every nibble and every stored scale code of both formats.

The asm itself only runs in compiled CUDA (Gluon); the GPU tests check the kernels bit for bit
against the reference. This test checks the arithmetic of the text the kernels embed on a
machine without a GPU: each decoded bf16 value, times the kernel's fold, must be exactly
``E2M1(code) * scale``, with -0 kept.
"""

from __future__ import annotations

import math
import re
import struct

import pytest
import torch

from fp4moe.formats import E2M1_VALUES, e4m3_to_e5m3
from fp4moe.kernels.linear_mma import DECODE_ASM, FOLD_E4M3, FOLD_E8M0, scale_asm

M32 = 0xFFFFFFFF


def _bf16_to_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _float_to_bf16(x: float) -> int:
    """Round to nearest even (through fp32: the products here are exact in fp32)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    """prmt.b32 default mode: byte i of the result is byte (sel nibble i & 7) of {b, a}, or that
    byte's sign replicated when the nibble's bit 3 is set."""
    src = (b << 32) | a
    out = 0
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (s & 7))) & 0xFF
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def run_ptx(asm: str, operands: list[int], n_out: int) -> list[int]:
    """Interpret ``asm`` (the instructions the decode kernels use); ``operands`` are the inputs
    $n_out.. in order; returns $0..$(n_out - 1)."""
    regs: dict[str, int] = {f"${n_out + i}": v for i, v in enumerate(operands)}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return int(tok, 0) & M32

    for stmt in asm.replace("{\n", "\n").split(";"):
        stmt = stmt.strip().strip("{}").strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
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
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "mul.lo.u32":
            r = a[0] * a[1]
        elif op == "mad.lo.u32":
            r = a[0] * a[1] + a[2]
        elif op == "cvt.u32.u16":
            r = a[0] & 0xFFFF
        elif op == "prmt.b32":
            r = _prmt(a[0], a[1], a[2])
        elif op == "fma.rn.bf16x2":
            r = 0
            for half in (0, 16):
                x, y, z = (_bf16_to_float(v >> half) for v in a)
                r |= _float_to_bf16(x * y + z) << half
        else:  # the asm grew an instruction: teach the interpreter its semantics before trusting the test
            raise AssertionError(f"the PTX interpreter does not know {op!r}")
        regs[dst] = r & M32
    return [regs[f"${i}"] for i in range(n_out)]


# output k of the decode holds the nibble NIBBLE[k]; outputs 0, 1, 4, 5 use the first scale pair
NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]
ROW_G = [True, True, False, False, True, True, False, False]


def _nvfp4_scales() -> list[tuple[int, float]]:
    """(stored byte, scale) for every positive finite non-zero E4M3 scale."""
    out = []
    for b in range(1, 0x7F):
        e4m3 = torch.tensor([b], dtype=torch.uint8)
        scale = float(e4m3.view(torch.float8_e4m3fn).float())
        out.append((int(e4m3_to_e5m3(e4m3)), scale))
    return out


def _mxfp4_scales() -> list[tuple[int, float]]:
    """(stored byte, scale) for the E8M0 exponents the decoder takes (-106..27, the range
    ``check_weight_scale_range`` admits)."""
    return [(e + 127, 2.0 ** e) for e in range(-106, 28)]


@pytest.mark.parametrize("mxfp4", [False, True], ids=["nvfp4", "mxfp4"])
def test_decode_asm_is_exact_for_every_code_and_scale(mxfp4):
    scales = _mxfp4_scales() if mxfp4 else _nvfp4_scales()
    fold = FOLD_E8M0 if mxfp4 else FOLD_E4M3
    sasm = scale_asm(mxfp4)
    g = torch.Generator().manual_seed(0)
    for i, (code_g, scale_g) in enumerate(scales):
        code_h, scale_h = scales[(7 * i + 3) % len(scales)]  # the other row's scale: another value
        sg, sh = run_ptx(sasm, [code_g | (code_h << 8)], 2)
        # each code in each nibble over two words, the other nibbles random
        for start in (0, 8):
            codes = torch.randint(0, 16, (8,), generator=g).tolist()
            for c in range(start, start + 8):
                word_codes = codes[:]
                word_codes[c % 8] = c
                word = sum(v << (4 * p) for p, v in enumerate(word_codes))
                out = run_ptx(DECODE_ASM, [word, sg, sh], 8)
                for k in range(8):
                    code = word_codes[NIBBLE[k]]
                    got = _bf16_to_float(out[k]) * fold
                    want = E2M1_VALUES[code] * (scale_g if ROW_G[k] else scale_h)
                    assert got == want and math.copysign(1, got) == math.copysign(1, want), \
                        (mxfp4, code, scale_g, scale_h, k, got, want)


def test_interpreter_knows_every_instruction_of_the_asm():
    used = {s.split()[0] for s in (DECODE_ASM + scale_asm(False)).replace("{", "").replace("}", "").split(";")
            if s.strip() and not s.strip().startswith(".reg")}
    assert used <= {"mov.b32", "shr.u32", "and.b32", "mul.lo.u32", "mad.lo.u32", "cvt.u32.u16", "prmt.b32",
                    "fma.rn.bf16x2"}, used
