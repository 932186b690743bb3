"""Compile a Triton kernel for any NVIDIA target on a machine without a GPU, and read back what
the chip will see: shared memory, registers, spills and the MMA instructions in the PTX.

Compilation runs in subprocesses (``python -m fp4moe.plan.worker``) with TRITON_INTERPRET unset:
under the interpreter every @triton.jit object is an interpreter function that cannot be
compiled, and a subprocess also keeps compiler crashes (Triton aborts on some illegal programs)
from taking the caller down. A worker reports each request as soon as it is done, so an abort
costs only the request that caused it; the rest are compiled by a fresh worker.

What to compile is a ``fp4moe.target.compile_request.CompileRequest``. Results can be kept on disk
(``fp4moe.plan.cache.CompileCache``): pass ``cache=`` to ``cross_compile``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable

from ..target.compile_request import CompileRequest

if TYPE_CHECKING:
    from .cache import CompileCache

__all__ = ["CompiledKernel", "cross_compile", "mma_instructions"]


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


class _Queue:
    """The requests left to compile, handed one at a time to whichever worker is free, and the
    count of those finished (for ``progress``)."""

    def __init__(self, n: int, progress: Callable[[int, int], None] | None) -> None:
        self.pending = list(range(n - 1, -1, -1))  # popped from the end: in request order
        self.total, self.done = n, 0
        self.progress = progress
        self.lock = threading.Lock()

    def take(self) -> int | None:
        with self.lock:
            return self.pending.pop() if self.pending else None

    def finish(self) -> None:
        with self.lock:
            self.done += 1
            if self.progress is not None:
                self.progress(self.done, self.total)


def _serve(requests: list[CompileRequest], queue: _Queue, env: dict[str, str], deadline: float, timeout_s: float,
           results: list[CompiledKernel | None]) -> None:
    """One worker slot: a worker process compiles requests from ``queue`` one at a time until none
    is left; after a crash, a fresh worker goes on with the next."""
    index = queue.take()
    while index is not None:
        with tempfile.TemporaryFile("w+") as err, subprocess.Popen(
                [sys.executable, "-m", "fp4moe.plan.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=err, text=True, env=env) as proc:
            timed_out = threading.Event()

            def stop(proc: subprocess.Popen = proc, timed_out: threading.Event = timed_out) -> None:
                timed_out.set()
                proc.kill()

            timer = threading.Timer(max(1.0, deadline - time.monotonic()), stop)
            timer.start()
            try:
                while index is not None:
                    proc.stdin.write(json.dumps({"index": index, "request": asdict(requests[index])}) + "\n")
                    proc.stdin.flush()
                    line = proc.stdout.readline()
                    while line and not line.startswith("{"):  # anything else a library printed
                        line = proc.stdout.readline()
                    if not line:
                        break  # the worker died on this request
                    r = json.loads(line)
                    r.pop("index")
                    results[index] = _from_json(r)
                    queue.finish()
                    index = queue.take()
                else:
                    proc.stdin.close()
                    proc.wait()
                    return
            except BrokenPipeError:  # died before reading the request
                pass
            finally:
                timer.cancel()
            proc.kill()
            code = proc.wait()
            if timed_out.is_set():
                while index is not None:  # out of time: this request and every one not yet begun
                    results[index] = CompiledKernel(cc=requests[index].cc, ok=False,
                                                    error=f"cross-compilation timed out after {timeout_s:.0f} s")
                    queue.finish()
                    index = queue.take()
                return
            err.seek(0)
            log = err.read()
        # the request in flight crashed the compiler: record it, go on with a fresh worker
        results[index] = CompiledKernel(cc=requests[index].cc, ok=False,
                                        error=f"the compiler crashed ({_describe_exit(code)}):\n{log[-3000:]}")
        queue.finish()
        index = queue.take()


def _run_workers(requests: list[CompileRequest], jobs: int, timeout_s: float,
                 progress: Callable[[int, int], None] | None = None) -> list[CompiledKernel]:
    """Compile ``requests`` on up to ``jobs`` concurrent worker processes, each taking the next
    request as soon as it is free (compile times differ tenfold between requests); restart after
    a crash. ``progress(done, total)`` after each request."""
    results: list[CompiledKernel | None] = [None] * len(requests)
    queue = _Queue(len(requests), progress)
    env = _worker_env()
    deadline = time.monotonic() + timeout_s
    slots = max(1, min(jobs, len(requests)))
    with ThreadPoolExecutor(slots) as pool:
        list(pool.map(lambda _: _serve(requests, queue, env, deadline, timeout_s, results), range(slots)))
    return [r for r in results if r is not None]


def cross_compile(requests: list[CompileRequest], timeout_s: float = 600.0, *, jobs: int | None = None,
                  cache: CompileCache | None = None,
                  progress: Callable[[int, int], None] | None = None) -> list[CompiledKernel]:
    """Compile every request and return one result per request (in order).

    ``jobs`` worker processes share the requests (default: one per CPU core, at most one per
    request). With ``cache``, results found there are not compiled again and new ones are stored.
    ``progress(done, total)`` is called as each compilation that was not in the cache finishes.
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
        compiled = _run_workers(unique, n_jobs, timeout_s, progress)
        for indices, req, res in zip(todo.values(), unique, compiled):
            if cache is not None:
                cache.put(req, res)
            for i in indices:
                results[i] = res
    return [r for r in results if r is not None]
