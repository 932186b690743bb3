"""Compile a Triton kernel for any NVIDIA target on a machine without a GPU, and read back what
the chip will see: shared memory, registers, spills and the MMA instructions in the PTX.

Compilation runs in a subprocess (``python -m fp4moe.plan.worker``) with TRITON_INTERPRET unset:
under the interpreter every @triton.jit object is an interpreter function that cannot be
compiled, and a subprocess also keeps compiler crashes (Triton aborts on some illegal programs)
from taking the caller down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CompileRequest", "CompiledKernel", "cross_compile", "mma_instructions"]


@dataclass(frozen=True)
class CompileRequest:
    """What to compile: ``kernel`` as "module:function", Triton signature types by argument name
    (e.g. ``{"x_ptr": "*bf16", "M": "i32"}``), constexpr values (dtypes as "bf16"/"fp16"/"fp32"),
    the target compute capability (90, 100, 120 ...) and launch options."""

    kernel: str
    signature: dict[str, str]
    constexprs: dict[str, Any]
    cc: int
    num_warps: int = 4
    num_stages: int = 3
    divisible_by_16: tuple[str, ...] = ()  # arguments the runtime would specialise as multiples of 16


@dataclass(frozen=True)
class CompiledKernel:
    cc: int
    ok: bool
    error: str | None = None
    shared: int | None = None  # bytes of shared memory per block (metadata.shared)
    registers: int | None = None  # per thread, from ptxas -v
    spill_bytes: int | None = None  # spill stores + loads, from ptxas -v
    mma: tuple[str, ...] = field(default_factory=tuple)  # distinct MMA instruction forms in the PTX
    ptxas_log: str = ""


def mma_instructions(ptx: str) -> tuple[str, ...]:
    """Distinct MMA instruction mnemonics in PTX (mma.sync..., wgmma.mma_async..., tcgen05.mma...)."""
    found = set()
    for line in ptx.splitlines():
        words = line.replace("\t", " ").split()
        if words and words[0].startswith("@"):  # predicated instruction: @%p1 tcgen05.mma ...
            words = words[1:]
        word = words[0] if words else ""
        if word.startswith(("mma.sync", "wgmma.mma_async", "tcgen05.mma")):
            found.add(word)
    return tuple(sorted(found))


def cross_compile(requests: list[CompileRequest], timeout_s: float = 600.0) -> list[CompiledKernel]:
    """Compile every request in one subprocess and return one result per request (in order)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    payload = json.dumps([asdict(r) for r in requests])
    proc = subprocess.run([sys.executable, "-m", "fp4moe.plan.worker"], input=payload, capture_output=True,
                          text=True, env=env, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"cross-compilation worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return [CompiledKernel(**{**r, "mma": tuple(r["mma"])}) for r in results]
