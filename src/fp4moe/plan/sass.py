"""SASS checks of compiled kernels (no GPU needed: ptxas and cuobjdump ship with Triton).

``wgmma_register_hazards`` finds instructions that touch the registers of a ``wgmma`` still in
flight: writes to its A operand (when A comes from registers) and reads or writes of its
accumulator. The PTX rule ("accessing the accumulator register or the input register
containing the fragments of matrix A of a wgmma.mma_async instruction without first performing a
wgmma.wait_group instruction that waits on a wgmma-group including that wgmma.mma_async
instruction is undefined behavior") is the program's to keep, and Triton 3.6 does not keep it for
a register A operand with one wgmma group left in flight (triton-lang/triton#9433, fixed after
3.6): ptxas is free to hand the operand's registers to the next instructions once the wgmma is
issued, e.g. to the next chunk's weight words while the wgmma still reads them (wrong rows), so the
prefill kernel's machine code is checked here.

The check is a forward data-flow pass over the control-flow graph (branches followed, paths
joined), so straight-line code after a loop and code reached through out-of-line branches are
covered as well as loop bodies. An HGMMA group ends at ``gsb0``; ``WARPGROUP.DEPBAR.LE gsb0, n``
retires all but the n newest groups.
"""

from __future__ import annotations

import re

__all__ = ["count_hgmma", "wgmma_register_hazards"]

_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")
_PRED = re.compile(r"!?U?P(?:\d+|T)")
_REG = re.compile(r"(?<![A-Za-z0-9_])R(\d+)")
# instructions whose first operand is not a register they write
_NO_DEST = ("ST", "BAR", "BRA", "RED", "LDGSTS", "SYNCS", "UTMA", "WARPSYNC", "EXIT", "RET", "CALL", "NOP",
            "WARPGROUP", "DEPBAR", "MEMBAR", "FENCE", "CCTL", "ERRBAR", "BSSY", "BSYNC", "ATOMS", "YIELD")
# instructions that may write a predicate before their register result (``SHFL.BFLY PT, R5, ...``)
_PRED_THEN_REG = ("SHFL", "LOP3", "PLOP3")
_MAX_GROUPS = 16  # older in-flight groups are merged into the oldest kept one (stays conservative)


def _parse(sass: str) -> list[tuple[int, bool, str, list[str]]]:
    """(address, unconditional, opcode, operands) of every instruction."""
    out = []
    for line in sass.splitlines():
        m = _INSN.search(line)
        if m:
            guard = (m.group(2) or "").strip()
            ops = [o.strip() for o in m.group(4).split(",")] if m.group(4).strip() else []
            out.append((int(m.group(1), 16), guard in ("", "@PT", "@UPT"), m.group(3), ops))
    return out


def _regs(token: str, width: int) -> frozenset[int]:
    m = re.fullmatch(r"R(\d+)(?:\.\w+)?", token)
    return frozenset(range(int(m.group(1)), int(m.group(1)) + width)) if m else frozenset()


def _dest_width(opcode: str) -> int:
    if ".128" in opcode or (opcode.startswith("LDSM") and ".x4" in opcode.lower()):
        return 4
    if (".64" in opcode or ".WIDE" in opcode or opcode.startswith(("CS2R", "DADD", "DMUL", "DFMA"))
            or (opcode.startswith("LDSM") and ".x2" in opcode.lower()) or opcode.startswith("HMMA")):
        return 2 if not (opcode.startswith("HMMA") and ".F32" in opcode) else 4
    return 1


def _dest(opcode: str, ops: list[str]) -> frozenset[int]:
    if not ops or ops[0].startswith("[") or opcode.startswith(_NO_DEST) or opcode.startswith("HGMMA"):
        return frozenset()
    first = ops[0]
    if _PRED.fullmatch(first):
        if not (opcode.startswith(_PRED_THEN_REG) and len(ops) > 1):
            return frozenset()
        first = ops[1]
    return _regs(first, _dest_width(opcode))


def _reads(ops: list[str], skip_first: bool) -> frozenset[int]:
    return frozenset(int(r) for o in (ops[1:] if skip_first else ops) for r in _REG.findall(o))


def _hgmma_regs(opcode: str, ops: list[str]) -> tuple[frozenset[int], frozenset[int]]:
    """(A registers, accumulator registers) of one HGMMA: A from registers when the second operand
    is a register (4 per k16 step), accumulators N/2 per thread of a 64xN fp32 tile."""
    a = _regs(ops[1], 4) if len(ops) > 1 else frozenset()
    n = re.search(r"HGMMA\.64x(\d+)x", opcode)
    width = int(n.group(1)) // 2 if n and ".F32" in opcode else (int(n.group(1)) // 4 if n else 1)
    return a, _regs(ops[0], width) if ops else frozenset()


State = tuple[tuple[frozenset, ...], frozenset]  # in-flight groups (oldest first), open group; each a set of (kind, reg)


def _join(a: State | None, b: State) -> State:
    if a is None:
        return b
    (ga, ca), (gb, cb) = a, b
    n = max(len(ga), len(gb))
    ga = (frozenset(),) * (n - len(ga)) + ga
    gb = (frozenset(),) * (n - len(gb)) + gb
    return tuple(x | y for x, y in zip(ga, gb)), ca | cb


def _scan(sass: str) -> tuple[list[tuple[str, str, str]], int]:
    ins = _parse(sass)
    index = {a: i for i, (a, _, _, _) in enumerate(ins)}
    states: list[State | None] = [None] * len(ins)
    if ins:
        states[0] = ((), frozenset())
    work = [0] if ins else []
    found: set[tuple[str, str, str]] = set()
    while work:
        i = work.pop()
        addr, uncond, op, ops = ins[i]
        groups, current = states[i]
        groups = list(groups)
        if op.startswith("HGMMA"):
            a, acc = _hgmma_regs(op, ops)
            current = current | {("a", r) for r in a} | {("acc", r) for r in acc}
            if any("gsb0" in o for o in ops[1:]):
                groups.append(current)
                current = frozenset()
                if len(groups) > _MAX_GROUPS:
                    groups = [groups[0] | groups[1]] + groups[2:]
        elif op.startswith("WARPGROUP.DEPBAR"):
            keep = int(ops[-1], 16) if ops else 0
            groups = groups[len(groups) - keep:] if keep else []
        else:
            live = current.union(*groups) if groups else current
            if live:
                written = _dest(op, ops)
                acc = {r for k, r in live if k == "acc"}
                a_regs = {r for k, r in live if k == "a"}
                touched = (written & (acc | a_regs)) | (_reads(ops, bool(written)) & acc)
                if touched:
                    found.add((hex(addr), op, f"R{min(touched)}"))
        out: State = (tuple(groups), current)
        succ = []
        if op.startswith("BRA") and ops and re.fullmatch(r"0x[0-9a-f]+", ops[0]) and int(ops[0], 16) in index:
            succ.append(index[int(ops[0], 16)])
        ends = (op.startswith("BRA") or op in ("EXIT", "RET")) and uncond
        if not ends and i + 1 < len(ins):
            succ.append(i + 1)
        for s in succ:
            joined = _join(states[s], out)
            if joined != states[s]:
                states[s] = joined
                work.append(s)
    n_hgmma = sum(1 for _, _, op, _ in ins if op.startswith("HGMMA"))
    return sorted(found), n_hgmma


def wgmma_register_hazards(sass: str) -> list[tuple[str, str, str]]:
    """(address, opcode, register) of every instruction that writes a register an in-flight HGMMA
    reads as its A operand, or reads or writes its accumulator (see the module docstring)."""
    return _scan(sass)[0]


def loop_local_memory_ops(sass: str) -> int:
    """Local-memory instructions (spill stores and loads, ``STL``/``LDL``) that may run every
    iteration of a loop; spills outside the loops run once per tile or program.

    wgmma kernels: the address ranges of the backward branches whose body holds an HGMMA, among the
    branches before the kernel's final EXIT (ptxas places the mbarrier wait's retry blocks after
    it, and their branches back into the body are not loops of their own); a kernel with tile
    variants has one main loop each. Without such a branch (a loop unrolled completely), the range
    from the first to the last HGMMA. Other kernels: every local-memory instruction when the kernel
    has any backward branch at all (an address range would miss a loop laid out across an EXIT or a
    subroutine), none when it has no loop (the quantizer; the planner bounds those spills by size,
    ``planner.LOOP_FREE_SPILL_LIMIT_BYTES``)."""
    insns = _parse(sass)
    if not insns:
        return 0
    local = [addr for addr, _, op, _ in insns if op.startswith(("STL", "LDL"))]
    hgmma = [addr for addr, _, op, _ in insns if op.startswith("HGMMA")]
    branches = []
    for addr, _, op, ops in insns:
        if op.startswith("BRA") and ops:
            try:
                branches.append((int(ops[-1].split()[-1], 16), addr))
            except ValueError:
                continue
    if not hgmma:  # (a branch to itself is the closing trap after the last EXIT, not a loop)
        return len(local) if any(target < addr for target, addr in branches) else 0
    end = next((addr for addr, always, op, _ in insns if op == "EXIT" and always and addr > hgmma[-1]),
               insns[-1][0])
    loops = [(t, a) for t, a in branches if t < a <= end and any(t <= h <= a for h in hgmma)]
    if not loops:
        loops = [(hgmma[0], hgmma[-1])]
    return sum(any(lo <= addr <= hi for lo, hi in loops) for addr in local)


def count_hgmma(sass: str) -> int:
    """HGMMA instructions in ``sass``: a hazard check that saw none checked nothing."""
    return _scan(sass)[1]

