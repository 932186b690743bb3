"""Compile a Triton kernel for any NVIDIA target on a machine without a GPU, and read back what
the chip will see: shared memory, registers, spills and the MMA instructions in the PTX.

Compilation runs in subprocesses (``python -m fp4moe.plan.worker``) with TRITON_INTERPRET unset:
under the interpreter every @triton.jit object is an interpreter function that cannot be
compiled, and a subprocess also keeps compiler crashes (Triton aborts on some illegal programs)
from taking the caller down. A worker reports each request as soon as it is done, so an abort
costs only the request that caused it; the rest are compiled by a fresh worker.

Results can be kept on disk (``fp4moe.plan.cache.CompileCache``): pass ``cache=`` to
``cross_compile``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cache import CompileCache

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
    maxnreg: int | None = None  # the launch's register cap (warp-specialized kernels split it with setmaxnreg)


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
    smem_buffers: tuple[str, ...] = ()  # explicit shared buffers in the TTGIR (e.g. "2x128x64xi8")
    compile_s: float | None = None  # seconds the compilation took (not counting a cache hit)
    # SASS writes to registers an in-flight register-A wgmma still reads (plan.sass); wgmma kernels only
    wgmma_hazards: tuple[str, ...] = ()
    # spill stores and loads inside loops (plan.sass.loop_local_memory_ops); None where SASS was not read
    loop_spill_ops: int | None = None

    @property
    def uses_wgmma(self) -> bool:
        """A wgmma kernel: its SASS is read for register hazards and for where its main loops are."""
        return any(m.startswith("wgmma") for m in self.mma)


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


def _from_json(r: dict) -> CompiledKernel:
    known = {f for f in CompiledKernel.__dataclass_fields__}
    values = {k: v for k, v in r.items() if k in known}
    values["mma"] = tuple(values.get("mma") or ())
    values["smem_buffers"] = tuple(values.get("smem_buffers") or ())
    values["wgmma_hazards"] = tuple(values.get("wgmma_hazards") or ())
    return CompiledKernel(**values)


def _worker_env() -> dict[str, str]:
    # the worker compiles for the requests' targets: no interpreter, no other architecture's lowering
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_OVERRIDE_ARCH", "FP4MOE_ARCH")}
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _run_share(requests: list[CompileRequest], share: list[int], env: dict[str, str], timeout_s: float,
               results: list[CompiledKernel | None]) -> list[int]:
    """One worker compiles the requests ``share``; returns those left to retry after a crash."""
    proc = subprocess.Popen([sys.executable, "-m", "fp4moe.plan.worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    payload = json.dumps([asdict(requests[i]) for i in share])
    try:
        out, err = proc.communicate(payload, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        for i in share:
            if results[i] is None:
                results[i] = CompiledKernel(cc=requests[i].cc, ok=False,
                                            error=f"cross-compilation timed out after {timeout_s:.0f} s")
        return []
    done = 0
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[share[r.pop("index")]] = _from_json(r)
            done += 1
    if done == len(share):
        return []
    if proc.returncode == 0:
        raise RuntimeError(f"cross-compilation worker returned {done} of {len(share)} results:\n{err[-4000:]}")
    # the request after the last reported one crashed the compiler: record it, retry the rest
    crashed = share[done]
    results[crashed] = CompiledKernel(cc=requests[crashed].cc, ok=False,
                                      error=f"the compiler crashed ({_describe_exit(proc.returncode)}):\n{err[-3000:]}")
    return share[done + 1:]


def _run_workers(requests: list[CompileRequest], jobs: int, timeout_s: float) -> list[CompiledKernel]:
    """Compile ``requests`` on up to ``jobs`` concurrent worker processes; restart after a crash."""
    results: list[CompiledKernel | None] = [None] * len(requests)
    pending = list(range(len(requests)))
    env = _worker_env()
    deadline = time.monotonic() + timeout_s
    while pending:
        shares = [pending[i::jobs] for i in range(min(jobs, len(pending)))]
        left = max(1.0, deadline - time.monotonic())
        with ThreadPoolExecutor(len(shares)) as pool:
            retries = list(pool.map(lambda share: _run_share(requests, share, env, left, results), shares))
        pending = [i for retry in retries for i in retry]
    return [r for r in results if r is not None]


def cross_compile(requests: list[CompileRequest], timeout_s: float = 600.0, *, jobs: int | None = None,
                  cache: CompileCache | None = None) -> list[CompiledKernel]:
    """Compile every request and return one result per request (in order).

    ``jobs`` worker processes share the requests (default: one per CPU core, at most one per
    request). With ``cache``, results found there are not compiled again and new ones are stored.
    """
    requests = list(requests)
    results: list[CompiledKernel | None] = [None] * len(requests)
    todo: dict[str, list[int]] = {}  # one compilation per distinct request
    for i, req in enumerate(requests):
        hit = cache.get(req) if cache is not None else None
        if hit is not None:
            results[i] = hit
        else:
            todo.setdefault(json.dumps(asdict(req), sort_keys=True), []).append(i)
    if todo:
        unique = [requests[indices[0]] for indices in todo.values()]
        n_jobs = max(1, min(jobs or os.cpu_count() or 1, len(unique)))
        compiled = _run_workers(unique, n_jobs, timeout_s)
        for indices, req, res in zip(todo.values(), unique, compiled):
            if cache is not None:
                cache.put(req, res)
            for i in indices:
                results[i] = res
    return [r for r in results if r is not None]
