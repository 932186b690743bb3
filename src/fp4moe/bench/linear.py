"""Benchmarks of the FP4 linear layer and of the activation quantizer, against torch bf16.

One row per (shape, M, mode). Weights rotate through enough copies to exceed 4 x L2 (see
``timing``), so small-M rows measure HBM streaming, not L2 hits; x stays put, as the previous
layer's output would. Every time comes from ``timing``: the modes of one (shape, M) and the torch
baseline with their replays interleaved (``time_cuda_graphs``), so all run under the same clocks,
which NVML records where it is available (``sm_mhz``, ``power_w``, ``power_capped``: sustained
prefill on an H200 runs at its 700 W cap); every ratio from ``roofline``. A failing row records ``"error: ..."`` and the run goes on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from rich.console import Console

from ..formats import FP4Format, get_format
from ..target import roofline as rl
from .report import one_line
from .timing import (ClockMonitor, TimingResult, l2_bytes, measure_ceilings, rotating, rotation_count, time_cuda_graph,
                     time_cuda_graphs)

__all__ = [
    "GLM5_SHAPES",
    "DEFAULT_MS",
    "QUICK_MS",
    "MODES",
    "bench_ceilings",
    "linear_metrics",
    "run_linear_bench",
    "run_quantize_bench",
]

#: GLM-5 linear shapes N x K (hidden size 6144): the layer's weight is [N, K].
GLM5_SHAPES: tuple[tuple[int, int], ...] = ((12288, 6144), (6144, 12288), (4096, 6144), (6144, 2048))
#: Token counts from single-token decode to long prefill.
DEFAULT_MS: tuple[int, ...] = (1, 4, 16, 64, 256, 1024, 4096, 16384)
QUICK_MS: tuple[int, ...] = (1, 16, 256, 4096)
from . import MODES  # noqa: E402


def bench_ceilings() -> dict[str, Any]:
    """Measured copy bandwidth, bf16 peak and L2 size, plus the datasheet FP4 peak where FP4 MMA exists.

    No FP4 peak can be measured without the kernel under test, so W4A4 rows on chips with FP4
    tensor cores are held against the catalogue's dense FP4 figure (labelled as such).
    """
    import torch

    from .. import target as arch
    from ..ops._runtime import device_arch

    ceilings: dict[str, Any] = dict(measure_ceilings())
    detected = arch.detect()
    gpu = detected.gpu if detected else None
    # W4A4 on FP4 MMA only where the kernels that run use it (FP4MOE_ARCH may name an architecture without)
    native = gpu is not None and device_arch(torch.device("cuda")).has_native_fp4
    ceilings["fp4_tflops_datasheet"] = gpu.fp4_dense_tflops if native else None
    return ceilings


def _peak(mode: str, ceilings: Mapping[str, Any]) -> float:
    fp4 = ceilings.get("fp4_tflops_datasheet")
    return float(fp4) if mode == "w4a4" and fp4 else float(ceilings["bf16_tflops"])


def linear_metrics(
    M: int, N: int, K: int, fmt: str | FP4Format, mode: str, us: float, ceilings: Mapping[str, Any],
    torch_us: float | None = None,
) -> dict[str, float | None]:
    """Derived numbers of one timed linear: bandwidth, throughput and fractions of the bounds.

    ``frac_weight_bound``: (FP4 weight + scale bytes / copy bandwidth) / time.
    ``frac_roofline``: max(least bytes / copy bandwidth, FLOPs / peak) / time, with the peak of
    ``_peak`` (measured bf16; datasheet FP4 for W4A4 where the chip has FP4 MMA).
    """
    bandwidth = float(ceilings["copy_gbs"])
    weight = rl.fp4_weight_bytes(N, K, fmt)
    flops = rl.linear_flops(M, N, K)
    bound = rl.roofline_us(rl.linear_bytes(M, N, K, fmt), flops, bandwidth, _peak(mode, ceilings))
    return {
        "weight_gbs": rl.gbs(weight, us),
        "tflops": rl.tflops(flops, us),
        "frac_weight_bound": rl.fraction(us, weight / (bandwidth * 1e3)),
        "frac_roofline": rl.fraction(us, bound),
        "speedup": None if torch_us is None else torch_us / us,
    }


def _error(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"error: {type(err).__name__}" + (f": {lines[0][:200]}" if lines else "")


def _config(M: int, N: int, K: int, mode: str, chip: Any, sm_count: int | None, fmt: str = "nvfp4",
            l2: int | None = None) -> str:
    """``str(choose_config(...))`` of ops.linear, as ``fp4_linear`` would choose it; "" where there is none."""
    try:
        from ..ops import linear as ops_linear  # written in parallel; may not exist yet
    except ImportError:
        return ""
    choose = getattr(ops_linear, "choose_config", None)
    try:
        if choose is None:
            return ""
        if hasattr(ops_linear, "choose_path"):  # choose_config(M, N, K, *, path, arch, sm_count)
            path = ops_linear.choose_path(mode, chip)
            if ops_linear.dequant_matmul_applies(path, chip, M, N, K, fmt):
                return "dequantize_weight+torch.matmul"
            # bf16 x: the packed-layout kernels, chosen for this device's L2 as fp4_linear does
            packed = ops_linear.packed_config(path, chip, M, N, K, sm_count, fmt=fmt, l2_bytes=l2)
            return str(packed if packed is not None else choose(M, N, K, path=path, arch=chip, sm_count=sm_count))
        return str(choose(M, N, K, mode=mode, arch=chip))
    except Exception as err:  # a config failure is worth seeing, but the row stays a timing
        return _error(err)


def _linear_row(shape: str, M: int, mode: str, fmt: str) -> dict[str, Any]:
    keys = ("us", "p10_us", "p90_us", "torch_us", "speedup", "weight_gbs", "tflops", "frac_weight_bound",
            "frac_roofline", "sm_mhz", "power_w", "power_capped", "graph", "timing", "config", "error")
    return {"kind": "linear", "shape": shape, "M": M, "mode": mode, "fmt": fmt, **dict.fromkeys(keys)}


def _progress(console: Console, row: Mapping[str, Any]) -> None:
    label = f"{row['kind']} {row['shape']} M={row['M']:<5} {row.get('mode') or 'scale=' + str(row.get('global_scale'))}"
    if row.get("error"):
        console.print(f"{label}: [red]{one_line(row['error'])}[/red]")
        return
    torch_us = row.get("torch_us")
    torch_part = f", torch {torch_us:.1f} µs" if torch_us else ""
    frac = row.get("frac_weight_bound", row.get("frac_copy"))
    console.print(f"{label}: {row['us']:.1f} µs, {frac:.0%} of the bound{torch_part}")


def _timing_kwargs(reps: int, iters_per_graph: int, budget_ms: float | None, n_sets: int) -> dict[str, Any]:
    return {"reps": reps, "iters_per_graph": max(iters_per_graph, n_sets), "budget_ms": budget_ms}


def run_linear_bench(
    shapes: Sequence[tuple[int, int]] = GLM5_SHAPES,
    ms: Sequence[int] = DEFAULT_MS,
    modes: Sequence[str] = MODES,
    fmt: str = "nvfp4",
    *,
    ceilings: Mapping[str, Any] | None = None,
    reps: int = 30,
    iters_per_graph: int = 20,
    budget_ms: float | None = 400.0,
    torch_baseline: bool = True,
    console: Console | None = None,
    seed: int = 0,
    cooldown_s: float = 3.0,
) -> list[dict[str, Any]]:
    """Time ``fp4_linear(x, w, mode=...)`` and ``torch.matmul(x, w_bf16.t())`` for each (shape, M, mode).

    Weights are random bf16 [N, K] quantized with ``fp4moe.quantize(w, fmt)`` on the GPU; W4A4
    with NVFP4 gets a static ``input_global_scale`` (amax(x) / (6 * 448)) as calibrated
    checkpoints carry. The torch baseline is skipped (None) when it would not fit in memory.
    ``budget_ms`` bounds the replays of the slowest of each (shape, M)'s calls, which are timed
    interleaved (see ``time_cuda_graphs``). ``ceilings`` defaults
    to :func:`bench_ceilings`, measured now. Progress goes to ``console`` (a new rich Console).
    Each shape after the first starts ``cooldown_s`` seconds after the last (prefill) row of the one
    before: sustained prefill holds the GPU at its power cap (the H200 at 1.4-1.5 GHz instead of
    1.98, ``tools/profile/diag_prefill_sustained.py``), and the decode rows would otherwise run clocked down.
    """
    import time

    import torch

    from .. import target as arch
    from ..ops._runtime import device_arch
    from ..quantize import quantize

    fmt = get_format(fmt).name
    console = console or Console()
    ceilings = ceilings if ceilings is not None else bench_ceilings()
    detected = arch.detect()
    # the architecture whose kernels run (FP4MOE_ARCH may name another than the GPU's)
    chip = device_arch(torch.device("cuda")) if detected else None
    sm_count = detected.sm_count if detected else None
    l2 = int(ceilings.get("l2_bytes") or l2_bytes())
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows: list[dict[str, Any]] = []
    for i, (N, K) in enumerate(shapes):
        shape = f"{N}x{K}"
        if i and cooldown_s > 0:
            torch.cuda.synchronize()
            time.sleep(cooldown_s)
        try:
            w = quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen), fmt)
            n_fp4 = rotation_count(rl.fp4_weight_bytes(N, K, fmt), l2)
            fp4_sets = [(w,)] + [(replace(w, data=w.data.clone(), scales=w.scales.clone()),) for _ in range(n_fp4 - 1)]
            if "w4a16" in modes:  # decode calls read an MMA-order copy, packed once per weight outside capture
                from ..ops.linear import mma_packed

                for (q,) in fp4_sets:
                    mma_packed(q)
        except Exception as err:
            for M in ms:
                for mode in modes:
                    rows.append({**_linear_row(shape, M, mode, fmt), "error": _error(err)})
                    _progress(console, rows[-1])
            continue
        bf16_sets = _bf16_sets(w, l2) if torch_baseline else []
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            m_rows = {mode: _linear_row(shape, M, mode, fmt) for mode in modes}
            calls: dict[str, Any] = {}
            for mode in modes:
                try:
                    calls[mode] = _fp4_timed_call(x, fp4_sets, mode, fmt)
                except Exception as err:
                    m_rows[mode]["error"] = _error(err)
                    torch.cuda.empty_cache()
            torch_call = _torch_timed_call(x, bf16_sets, N) if torch_baseline else None
            if torch_call is not None:
                calls["torch"] = torch_call
            timing = _timing_kwargs(reps, iters_per_graph, budget_ms, max(len(fp4_sets), len(bf16_sets)))
            times, clocks, how = _time_together(calls, timing)
            torch_t = times.get("torch")
            torch_us = torch_t.median_us if isinstance(torch_t, TimingResult) else None
            if isinstance(torch_t, TimingResult) and not torch_t.graph:
                how += ", torch eager"  # its capture failed: its time includes launches
            for mode in modes:
                row = m_rows[mode]
                row["torch_us"] = torch_us
                t = times.get(mode)
                if isinstance(t, BaseException):
                    row["error"] = _error(t)
                elif t is not None:
                    row.update(us=t.median_us, p10_us=t.p10_us, p90_us=t.p90_us, graph=t.graph, timing=how,
                               config=_config(M, N, K, mode, chip, sm_count, fmt, l2), **clocks)
                    row.update(linear_metrics(M, N, K, fmt, mode, t.median_us, ceilings, torch_us))
                rows.append(row)
                _progress(console, row)
            del x, calls
        del w, fp4_sets, bf16_sets
        torch.cuda.empty_cache()
    return rows


def _fp4_timed_call(x: Any, fp4_sets: Sequence[tuple[Any]], mode: str, fmt: str) -> Callable[[], Any]:
    """The rotating ``fp4_linear`` call to time, after launching it once on every weight set: a
    served model's weights have all run before a graph is captured (a pack's first launch waits
    for the kernel before it, PDL = 1, ``ops.mma_layout._launch_kw``; later ones do not), and a
    guard failure surfaces here, as this mode's error."""
    from ..ops.linear import fp4_linear  # written in parallel: imported when used
    from ..quantize import nvfp4_global_scale

    gs = nvfp4_global_scale(x.abs().amax()) if mode == "w4a4" and fmt == "nvfp4" else None
    call = functools.partial(_fp4_call, fp4_linear, x, mode=mode, input_global_scale=gs)
    for s in fp4_sets:
        call(*s)
    return rotating(call, fp4_sets)


def _fp4_call(fp4_linear: Any, x: Any, w: Any, *, mode: str, input_global_scale: Any) -> Any:
    return fp4_linear(x, w, mode=mode, input_global_scale=input_global_scale)


def _torch_timed_call(x: Any, sets: Sequence[tuple[Any]], N: int) -> Callable[[], Any] | None:
    """The rotating ``torch.matmul(x, w_bf16.t())``; None when skipped: no weight copies fit, or
    its output would take more than half the free memory."""
    import torch

    if not sets or x.shape[0] * N * 2 > torch.cuda.mem_get_info()[0] // 2:
        return None
    return rotating(lambda w: torch.matmul(x, w.t()), sets)


def _time_together(calls: Mapping[str, Callable[[], Any]], timing: Mapping[str, Any],
                   ) -> tuple[dict[str, TimingResult | BaseException], dict[str, float], str]:
    """Every call timed with its replays interleaved (``time_cuda_graphs``: the same clocks for the
    FP4 modes and the torch baseline), the clocks NVML saw meanwhile, and how they were timed
    ("interleaved", or "separate" where the joint timing failed and each call was timed alone, so
    that one failing call costs only its own row; the rows say so, as their clocks may differ)."""
    import torch

    if not calls:
        return {}, {}, "interleaved"
    times: dict[str, TimingResult | BaseException] = {}
    how = "interleaved"
    with ClockMonitor() as monitor:
        try:
            times.update(time_cuda_graphs(calls, **timing))
        except Exception:
            torch.cuda.empty_cache()
            how = "separate"
            for name, call in calls.items():
                try:
                    times[name] = time_cuda_graph(call, **timing)
                except Exception as err:  # the torch baseline is context: its failure leaves torch_us None
                    times[name] = err
                    torch.cuda.empty_cache()
    return times, monitor.summary(), how


def _bf16_sets(w: Any, l2: int) -> list[tuple[Any]]:
    """Rotating copies of the dequantized weight for the torch baseline; [] when they do not fit."""
    import torch

    try:
        w_bf16 = w.dequantize(torch.bfloat16)
        n = rotation_count(w_bf16.numel() * 2, l2)
        if (n - 1) * w_bf16.numel() * 2 > torch.cuda.mem_get_info()[0] // 2:
            return []
        return [(w_bf16,)] + [(w_bf16.clone(),) for _ in range(n - 1)]
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return []


def run_quantize_bench(
    M: int = 16384,
    K: int = 6144,
    *,
    ceilings: Mapping[str, Any],
    reps: int = 30,
    iters_per_graph: int = 20,
    budget_ms: float | None = 400.0,
    console: Console | None = None,
) -> list[dict[str, Any]]:
    """Time ``ops.quantize.quantize_activations(x, global_scale)`` on bf16 [M, K], with and without a scale.

    Bytes counted: read x (2MK) + write codes (MK/2) + E4M3 scales (MK/16), whatever passes the
    kernel makes; without a given scale the amax pass is part of the measured time.
    """
    import torch

    from ..quantize import nvfp4_global_scale

    console = console or Console()
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * M * K + M * K // 2 + M * K // 16
    rows = []
    for label, scale in (("given", nvfp4_global_scale(x.abs().amax())), ("none", None)):
        row: dict[str, Any] = {"kind": "quantize", "shape": f"{M}x{K}", "M": M, "global_scale": label,
                               **dict.fromkeys(("us", "p10_us", "p90_us", "gbs", "frac_copy", "sm_mhz", "power_w", "power_capped",
                                                 "graph", "error"))}
        try:
            from ..ops.quantize import quantize_activations  # written in parallel: imported when used

            with ClockMonitor() as monitor:
                t = time_cuda_graph(functools.partial(quantize_activations, x, scale),
                                    reps=reps, iters_per_graph=iters_per_graph, budget_ms=budget_ms)
            row.update(us=t.median_us, p10_us=t.p10_us, p90_us=t.p90_us, graph=t.graph, **monitor.summary(),
                       gbs=rl.gbs(nbytes, t.median_us),
                       frac_copy=rl.fraction(t.median_us, nbytes / (float(ceilings["copy_gbs"]) * 1e3)))
        except Exception as err:
            row["error"] = _error(err)
        rows.append(row)
        _progress(console, row)
    return rows
