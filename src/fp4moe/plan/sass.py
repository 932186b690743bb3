"""SASS checks of compiled kernels (no GPU needed: ptxas and cuobjdump ship with Triton).

``wgmma_register_hazards`` finds instructions that write a register an in-flight ``wgmma`` still
reads as its A operand. The PTX rule ("accessing the input register containing the fragments of
matrix A ... without first performing a wgmma.wait_group ... is undefined behavior") is the
program's to keep, and Triton 3.6 does not keep it for a register A operand with one wgmma group
left in flight (triton-lang/triton#9433, fixed after 3.6): ptxas is free to hand the operand's
registers to the next instructions once the wgmma is issued. Our prefill kernel hit it (the next
chunk's weight words landed in the operand of the wgmma still running; wrong rows on the H200),
so its layout is checked here, on the machine code, for every configuration the tests compile.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
# instructions whose first operand is not a register they write
_NO_DEST = ("ST", "BAR", "BRA", "RED", "LDGSTS", "SYNCS", "UTMA", "WARPSYNC", "EXIT", "RET", "CALL", "NOP")


def _parse(sass: str) -> list[tuple[int, str, list[str]]]:
    out = []
    for line in sass.splitlines():
        m = _INSN.search(line)
        if m:
            ops = [o.strip() for o in m.group(3).split(",")] if m.group(3).strip() else []
            out.append((int(m.group(1), 16), m.group(2), ops))
    return out


def _regs(token: str, width: int) -> set[int]:
    m = re.fullmatch(r"R(\d+)(?:\.\w+)?", token)
    return set(range(int(m.group(1)), int(m.group(1)) + width)) if m else set()


def _dest_width(opcode: str) -> int:
    return 4 if ".128" in opcode else 2 if (".64" in opcode or ".WIDE" in opcode) else 1


def wgmma_register_hazards(sass: str) -> list[tuple[str, str, str]]:
    """(address, opcode, register) of every write, inside a loop that issues HGMMA, to a register
    that an HGMMA still in flight reads as its A operand. The loop body is walked twice so that
    groups left in flight at the back edge are seen by the next iteration's instructions; an HGMMA
    group ends at ``gsb0`` and ``WARPGROUP.DEPBAR.LE gsb0, n`` retires all but the n newest."""
    ins = _parse(sass)
    found = []
    loops = [(a, int(ops[0], 16)) for a, op, ops in ins
             if op == "BRA" and ops and re.fullmatch(r"0x[0-9a-f]+", ops[0]) and int(ops[0], 16) < a]
    for end, start in loops:
        body = [i for i in ins if start <= i[0] <= end]
        if not any(op.startswith("HGMMA") for _, op, _ in body):
            continue
        groups: list[set[int]] = []
        current: set[int] = set()
        for second in (False, True):
            for addr, op, ops in body:
                if op.startswith("HGMMA"):
                    if len(ops) > 1:
                        current |= _regs(ops[1], 4)  # A from registers: 4 registers per k16 step
                    if any("gsb0" in o for o in ops[1:]):
                        groups.append(current)
                        current = set()
                elif op.startswith("WARPGROUP.DEPBAR"):
                    keep = int(ops[-1], 16)
                    groups = groups[len(groups) - keep:] if keep else []
                elif second and ops and not ops[0].startswith("[") and not op.startswith(_NO_DEST):
                    live = current.union(*groups)
                    if _regs(ops[0], _dest_width(op)) & live:
                        found.append((hex(addr), op, ops[0]))
    return found


def sass_of_ptx(ptx: str, cc: int = 90) -> str:
    """The SASS of ``ptx`` assembled for ``sm_{cc}a`` by the ptxas and cuobjdump Triton ships."""
    import triton

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        src, obj = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        subprocess.run([os.path.join(bindir, "ptxas"), f"--gpu-name=sm_{cc}a", src, "-o", obj], check=True,
                       capture_output=True)
        return subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", obj], check=True, capture_output=True,
                              text=True).stdout
