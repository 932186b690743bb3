"""Timing on the GPU: the one place in fp4moe that measures time.

``time_cuda_graph`` captures ``iters_per_graph`` calls of a function in one CUDA graph and times
each replay with CUDA events, so launch overhead and Python do not count. Inputs that would sit
in L2 between calls are rotated (the pattern below), and the ceilings every benchmark is held
against (copy bandwidth, bf16 matmul peak) are measured here in the same run.

Rotation pattern, for inputs that must not stay in L2 (e.g. weights)::

    n = rotation_count(bytes_per_set, l2_bytes())          # together > 4 x L2, <= ~8 GB
    sets = [make_inputs() for _ in range(n)]               # or clones of one set
    result = time_cuda_graph(rotating(fn, sets), iters_per_graph=max(20, n))

``rotating`` advances through the sets on every call, also while the graph is captured, so
each captured call reads a different set and consecutive calls never share one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TimingResult",
    "summarize",
    "time_cuda_graph",
    "time_cuda_graphs",
    "time_plain_calls",
    "ClockMonitor",
    "rotation_count",
    "rotating",
    "l2_bytes",
    "measure_copy_bandwidth",
    "measure_bf16_peak",
    "measure_ceilings",
    "warm_up_gpu",
]

DEFAULT_L2_BYTES = 64 * 2**20  # used only when torch does not report the L2 size


@dataclass(frozen=True)
class TimingResult:
    """Per-call time in microseconds over ``n`` timed replays (or eager batches when ``graph`` is False)."""

    median_us: float
    p10_us: float
    p90_us: float
    n: int
    graph: bool = True


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) of sorted values."""
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(samples_us: Sequence[float], *, graph: bool = True) -> TimingResult:
    """Median, 10th and 90th percentile of per-call samples."""
    if not samples_us:
        raise ValueError("samples_us: expected at least one sample, got none")
    ordered = sorted(samples_us)
    return TimingResult(median_us=_percentile(ordered, 0.5), p10_us=_percentile(ordered, 0.1),
                        p90_us=_percentile(ordered, 0.9), n=len(ordered), graph=graph)


def _timed(run: Callable[[], Any], reps: int) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``run`` on the current stream, by CUDA events."""
    import torch

    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def time_plain_calls(fn: Callable[[], Any], *, calls: int = 1, reps: int = 3, before: Callable[[], Any] | None = None,
                     device=None) -> tuple[TimingResult, TimingResult]:
    """Per-call time of ``calls`` plain (eager) calls of ``fn`` made back to back, as a user makes
    them: (what the stream takes, from CUDA events around the calls: the larger of host and GPU time;
    the host time of making the calls, without the final synchronisation). The GPU is idle at the
    start of each of the ``reps`` repetitions, after ``before()`` (untimed: e.g. a barrier that starts
    every rank of a distributed job together). No graph: this is the number a graph replay is held
    to. On a CPU ``device`` both are the host time (the calls complete as they return)."""
    import time

    import torch

    if calls < 1 or reps < 1:
        raise ValueError(f"calls, reps: expected >= 1, got {calls}, {reps}")
    cuda = device is None or torch.device(device).type == "cuda"
    stream_us, host_us = [], []
    for _ in range(reps):
        if before is not None:
            before()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        host_us.append((time.perf_counter() - t) * 1e6 / calls)
        if cuda:
            end.record()
            end.synchronize()
            stream_us.append(start.elapsed_time(end) * 1e3 / calls)
        else:
            stream_us.append(host_us[-1])
    return summarize(stream_us, graph=False), summarize(host_us, graph=False)


def time_cuda_graph(
    fn: Callable[[], Any],
    *,
    iters_per_graph: int = 20,
    reps: int = 30,
    warmup: int = 3,
    budget_ms: float | None = None,
) -> TimingResult:
    """Time ``fn()`` per call: ``iters_per_graph`` calls captured in one CUDA graph, replayed ``reps`` times.

    Warm-up calls run eagerly on a side stream before capture (as torch's CUDA graph docs
    require; they also compile Triton kernels). When capture raises (``fn`` synchronizes,
    allocates pinned memory, ...), falls back to eager batches of ``iters_per_graph`` calls
    timed with events and returns ``graph=False``.

    ``budget_ms`` bounds the time spent replaying: from the last warm-up call's time, ``reps``
    is lowered (not below 5) and then ``iters_per_graph`` (not below 1) until it fits.
    """
    return time_cuda_graphs({"fn": fn}, iters_per_graph=iters_per_graph, reps=reps, warmup=warmup,
                            budget_ms=budget_ms)["fn"]

def time_cuda_graphs(
    fns: Mapping[str, Callable[[], Any]],
    *,
    iters_per_graph: int = 20,
    reps: int = 30,
    warmup: int = 3,
    budget_ms: float | None = None,
) -> dict[str, TimingResult]:
    """``time_cuda_graph`` for several functions at once, their replays interleaved.

    Each function gets its own graph (or eager batches where capture fails); each rep replays
    every graph once, starting one further along each time, so every function is timed under the
    same clocks. Timed one after the other, a sustained bf16 GEMM on an H200 meets its 700 W power
    cap and runs at 1.4-1.5 GHz where a cold GPU ran 1.98 (session 15,
    ``tools/profile/diag_prefill_sustained.py``): whichever is timed first is favoured.
    ``budget_ms`` bounds the replays of the slowest function, as ``time_cuda_graph``'s.
    """
    import torch

    if not fns:
        raise ValueError("fns: expected at least one function, got none")
    if iters_per_graph < 1 or reps < 1 or warmup < 1:
        raise ValueError(f"expected iters_per_graph, reps, warmup >= 1, got {iters_per_graph}, {reps}, {warmup}")
    last_ms = max(_warm_up(fn, warmup) for fn in fns.values())
    if budget_ms is not None:
        calls = max(1, int(budget_ms / max(last_ms, 1e-3)))
        reps = max(min(reps, 5), min(reps, calls // iters_per_graph))
        iters_per_graph = max(1, min(iters_per_graph, calls // reps))

    runners: dict[str, Callable[[], Any]] = {}
    graphs: dict[str, bool] = {}
    for name, fn in fns.items():
        def batch(fn: Callable[[], Any] = fn) -> None:
            for _ in range(iters_per_graph):
                fn()

        try:
            graph = _capture(batch)
        except Exception:  # this fn cannot be captured: its batches run eagerly
            _release_rng_after_failed_capture()
            torch.cuda.synchronize()
            batch()
            runners[name], graphs[name] = batch, False
            continue
        graph.replay()  # first replay uploads the graph
        runners[name], graphs[name] = graph.replay, True
    names = list(runners)
    events = {name: [] for name in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runners[name]()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: summarize([s.elapsed_time(e) * 1e3 / iters_per_graph for s, e in events[name]], graph=graphs[name])
            for name in names}


class ClockMonitor:
    """The SM clock, board power and power-cap throttling of the current GPU, sampled by NVML
    (``pynvml``, from nvidia-ml-py, when installed) every ``period_s`` in a thread while the
    ``with`` block runs. ``summary()``: median MHz and W and the fraction of samples throttled by
    the software power cap, or {} where NVML is not available. Context for a timing, not part of it.
    """

    POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap

    def __init__(self, period_s: float = 0.02) -> None:
        self.period_s = period_s
        self.samples: list[tuple[int, float, int]] = []
        self._nvml: Any = None
        self._handle: Any = None
        self._thread: Any = None
        self._stop: Any = None

    def __enter__(self) -> ClockMonitor:
        import threading

        try:
            import pynvml
            import torch

            pynvml.nvmlInit()
            uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
            self._handle = (pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}") if uuid is not None
                            else pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device()))
            self._nvml = pynvml
        except Exception:  # no pynvml, no driver, no GPU: no context, the timing is unaffected
            return self
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        nv, h = self._nvml, self._handle
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        while not self._stop.is_set():
            try:
                self.samples.append((nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                                     nv.nvmlDeviceGetPowerUsage(h) / 1000, reasons(h)))
            except Exception:  # a failed query loses one sample
                pass
            self._stop.wait(self.period_s)

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()  # NVML counts its inits: one shutdown per init
            except Exception:
                pass

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {}
        mhz = sorted(s[0] for s in self.samples)
        watts = sorted(s[1] for s in self.samples)
        capped = sum(1 for s in self.samples if s[2] & self.POWER_CAP)
        return {"sm_mhz": float(_percentile(mhz, 0.5)), "power_w": round(_percentile(watts, 0.5), 1),
                "power_capped": round(capped / len(self.samples), 3)}


def _warm_up(fn: Callable[[], Any], calls: int) -> float:
    """``calls`` eager calls on a side stream (torch's CUDA-graph docs ask for it before capture; they
    also compile Triton kernels); the milliseconds of the last one."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(calls - 1):
            fn()
        (last_ms,) = _timed(fn, 1)
    torch.cuda.current_stream().wait_stream(side)
    return last_ms


def _capture(fn: Callable[[], Any]):
    """``fn`` captured in a CUDA graph (raises what the capture raises)."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def kernel_times(fn: Callable[[], Any], calls: int = 20) -> dict[str, float]:
    """Mean CUDA time per call (us) of each kernel ``fn`` launches, by name (first 60 characters,
    then `` xN`` when it runs N times per call), over ``calls`` calls captured in one CUDA graph and
    replayed once under ``torch.profiler``. The sum can be less than the graph's time per call:
    launch gaps are not kernels."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    _warm_up(fn, 1)

    def batch() -> None:
        for _ in range(calls):
            fn()

    graph = _capture(batch)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    total: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for event in prof.events():
        if event.device_type.name == "CUDA":
            total[event.name[:60]] += event.device_time_total
            count[event.name[:60]] += 1
    return {name + (f" x{count[name] // calls}" if count[name] > calls else ""): us / calls
            for name, us in total.most_common()}


def _release_rng_after_failed_capture() -> None:
    """Undo what a failed capture leaves behind in the default CUDA generator.

    ``capture_begin`` puts the generator into capture mode and only a successful
    ``capture_end`` takes it out; without this, the next ``torch.randn`` on the device raises
    "Offset increment outside graph capture encountered unexpectedly". A fresh clone of the
    state (same seed and offset) is not in capture mode.
    """
    import torch

    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    try:
        gen.graphsafe_set_state(gen.clone_state())
    except (AttributeError, RuntimeError):  # older torch: nothing to undo or no way to
        pass


def rotation_count(bytes_per_set: int, l2: int, *, factor: int = 4, cap_bytes: int = 8 * 2**30) -> int:
    """How many input sets to cycle through so that together they exceed ``factor`` x L2.

    At least 1; never so many that they exceed ``cap_bytes`` together (unless one set does).
    """
    if bytes_per_set <= 0 or l2 <= 0:
        raise ValueError(f"expected positive sizes, got bytes_per_set={bytes_per_set}, l2={l2}")
    wanted = factor * l2 // bytes_per_set + 1
    return max(1, min(wanted, cap_bytes // bytes_per_set))


def rotating(fn: Callable[..., Any], sets: Sequence[tuple[Any, ...]]) -> Callable[[], Any]:
    """A no-argument callable whose i-th call is ``fn(*sets[i % len(sets)])``."""
    if not sets:
        raise ValueError("sets: expected at least one input set, got none")
    counter = iter(range(2**62))

    def call() -> Any:
        return fn(*sets[next(counter) % len(sets)])

    return call


def l2_bytes(device: int | None = None) -> int:
    """The L2 size torch reports for ``device`` (default: current), else 64 MiB."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
    return int(getattr(props, "L2_cache_size", 0)) or DEFAULT_L2_BYTES


def measure_copy_bandwidth(nbytes: int = 2**30) -> float:
    """GB/s of a device-to-device copy of ``nbytes``, counting bytes read and written.

    Captured in a CUDA graph, a same-dtype ``dst.copy_(src)`` becomes a memcpy node served by
    the copy engines, slower than the eager copy (H200: 2.74 against 4.23 TB/s). The copy is
    therefore the elementwise kernel ``torch.mul(src, 1, out=dst)``, which matches the eager
    ``copy_`` (4.25 TB/s) and is what a kernel that streams memory can reach.
    """
    import torch

    src = torch.randn(nbytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    result = time_cuda_graph(lambda: torch.mul(src, 1.0, out=dst), iters_per_graph=5, reps=20)
    return 2 * src.numel() * 4 / (result.median_us * 1e3)


def measure_bf16_peak(n: int = 8192) -> float:
    """TFLOP/s of ``torch.matmul`` of two random (never zero) bf16 [n, n] matrices.

    Sustained (graph replays back to back), as the benchmarks run: on an H200 this reads about
    690-720 TFLOP/s where a short burst of eager calls reads about 780 (power and clocks).
    """
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    result = time_cuda_graph(lambda: torch.matmul(a, b), iters_per_graph=5, reps=20)
    return 2 * n**3 / (result.median_us * 1e6)


def warm_up_gpu(seconds: float = 0.5) -> None:
    """Keep the GPU busy with bf16 matmuls for ``seconds`` so clocks are up before measuring."""
    import time

    import torch

    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def measure_ceilings() -> dict[str, float | int]:
    """The ceilings a benchmark run is held against, measured now on the current GPU (warmed up first)."""
    warm_up_gpu()
    return {"copy_gbs": measure_copy_bandwidth(), "bf16_tflops": measure_bf16_peak(), "l2_bytes": l2_bytes()}
