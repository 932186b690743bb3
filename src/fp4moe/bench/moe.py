"""Benchmark of one FP4 MoE layer against torch._grouped_mm in bf16, on model-preset shapes.

One row per (M, routing, OEA). The FP4 rows time routing (when ``fp4moe.ops.routing`` is
importable: the whole layer from router logits) or the experts alone (dispatch -> GEMM 1 ->
GEMM 2 -> combine), recorded in the ``scope`` column. The bound is the FP4 weight-read bound of
the experts the batch touches: unique experts x 3 x I x H x bytes-per-element / copy bandwidth.
The torch row is what REFERENCE.md measured: both GEMMs through ``torch._grouped_mm`` on bf16
weights, with the SwiGLU between them, tokens already sorted by expert; its replays interleave
with the FP4 layer's (``timing.time_cuda_graphs``), so both run under the same clocks, which NVML
records where it is available (``sm_mhz``, ``power_w``, ``power_capped``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console

from ..formats import get_format
from .report import one_line
from .timing import ClockMonitor, rotating, time_cuda_graphs

__all__ = ["DEFAULT_MS", "OEA_MS", "moe_bound_us", "run_moe_bench"]

DEFAULT_MS: tuple[int, ...] = (1, 4, 16, 64, 256, 1024, 4096, 16384)
OEA_MS: tuple[int, ...] = (8, 16, 32, 64)


def moe_bound_us(unique_experts: int, H: int, I: int, fmt: str, copy_gbs: float) -> float:
    """Microseconds to read the FP4 weights (and block scales) of the touched experts once."""
    f = get_format(fmt)
    nbytes = unique_experts * 3 * I * H * (0.5 + 1.0 / f.block_size)
    return nbytes / (copy_gbs * 1e3)


def _ids(T: int, E: int, k: int, routing: str, gen) -> Any:
    import torch

    if routing == "uniform":
        scores = torch.rand(T, E, device="cuda", generator=gen)
    elif routing == "zipf":  # expert e popular in proportion to 1 / (rank + 1)
        rank = torch.randperm(E, device="cuda", generator=gen).float()
        scores = torch.rand(T, E, device="cuda", generator=gen).log() * (rank + 1.0)  # Gumbel-top-k of 1/(rank+1)
    else:
        raise ValueError(f"routing: expected 'uniform' or 'zipf', got {routing!r}")
    return scores.topk(k, dim=1).indices.to(torch.int32)


def _grouped_mm_layer(x_sorted, w13t, w2t, offs, I: int):
    import torch

    h = torch._grouped_mm(x_sorted, w13t, offs=offs)
    g, u = h[:, :I], h[:, I:]
    h = (torch.nn.functional.silu(g) * u).to(torch.bfloat16)
    return torch._grouped_mm(h, w2t, offs=offs)


#: routings the timed graph cycles through: consecutive calls touch different experts, as the
#: consecutive MoE layers of a model read different weights, so that no call can find the experts of
#: the call before it in L2 (at one token the last ~50 MB a call reads would fit there)
ROUTING_SETS = 4


def run_moe_bench(
    model: str = "glm-5",
    *,
    tp: int = 1,
    ms: Sequence[int] = DEFAULT_MS,
    routings: Sequence[str] = ("uniform", "zipf"),
    mode: str = "w4a16",
    oea_ms: Sequence[int] = OEA_MS,
    oea_k0: int = 4,
    ceilings: Mapping[str, Any] | None = None,
    torch_baseline: bool = True,
    console: Console | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    import torch

    from ..models import get_model
    from ..ops.moe import moe_experts
    from .linear import bench_ceilings

    console = console or Console()
    spec = get_model(model)
    E, k, H = spec.n_experts, spec.routing.top_k, spec.hidden
    if spec.expert_intermediate % tp:
        raise ValueError(f"tp: {spec.expert_intermediate} is not divisible by {tp}")
    I = spec.expert_intermediate // tp
    fmt = spec.fmt if mode == "w4a16" else "nvfp4"
    ceilings = ceilings if ceilings is not None else bench_ceilings()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13, w2 = random_experts(E, H, I, fmt, gen, pack=mode == "w4a16")
    route = _router(spec)
    if torch_baseline:
        w13t = torch.randn(E, H, 2 * I, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2).contiguous().transpose(1, 2)
        w2t = torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2).contiguous().transpose(1, 2)
    rows: list[dict[str, Any]] = []
    cases = [(M, r, None) for M in ms for r in routings] + [(M, "uniform", k0) for M in oea_ms for k0 in (None, oea_k0)]
    # smallest batches first: a prefill row leaves the GPU at its power cap, clocked down for the rows after it
    for M, routing, k0 in sorted(dict.fromkeys(cases), key=lambda c: c[0]):
        row: dict[str, Any] = {"kind": "moe", "model": model, "tp": tp, "M": M, "routing": routing, "mode": mode,
                               "oea_k0": k0, "scope": None, "us": None, "unique_experts": None, "bound_us": None,
                               "frac_weight_bound": None, "tflops": None, "torch_us": None, "speedup": None,
                               "kept_weight": None, "sm_mhz": None, "power_w": None, "power_capped": None,
                               "timing": None, "error": None}
        try:
            x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=gen)
            if route is not None:
                sets = []
                for _ in range(ROUTING_SETS):
                    logits = torch.randn(M, E, device="cuda", dtype=torch.float32, generator=gen)
                    if routing == "zipf":
                        logits = logits + _zipf_bias(E, gen)
                    sets.append((logits,))
                routed = [route(logits, k0) for (logits,) in sets]
                all_ids = [r[0] for r in routed]
                ids = all_ids[0]
                fn = rotating(lambda logits: moe_experts(x, w13, w2, *route(logits, k0)[:2], mode=mode), sets)
                row["scope"] = "layer (routing..combine)"
                kept = [r[2].get("kept_weight") for r in routed if r[2]]
                row["kept_weight"] = sum(kept) / len(kept) if kept else None
            else:
                if k0 is not None:
                    raise RuntimeError("OEA needs fp4moe.ops.routing, which is not available")
                sets = [(_ids(M, E, k, routing, gen), torch.rand(M, k, device="cuda", generator=gen))
                        for _ in range(ROUTING_SETS)]
                all_ids = [i for i, _ in sets]
                ids = all_ids[0]
                fn = rotating(lambda i, w: moe_experts(x, w13, w2, i, w, mode=mode), sets)
                row["scope"] = "experts (dispatch..combine)"
            # OEA marks unfillable slots -1; the bound counts each routing's unique experts (their mean)
            unique = sum(int(torch.unique(i[i >= 0]).numel()) for i in all_ids) / len(all_ids)
            calls = {"fp4": fn}
            if torch_baseline and k0 is None:
                flat = ids.reshape(-1).long()
                order = torch.sort(flat, stable=True).indices
                x_sorted = x[order // k]
                offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
                calls["torch"] = lambda: _grouped_mm_layer(x_sorted, w13t, w2t, offs, I)
            # replays interleaved: the baseline under the same clocks (timing.time_cuda_graphs)
            row["timing"] = "interleaved" if "torch" in calls else "alone"
            with ClockMonitor() as monitor:
                try:
                    times = time_cuda_graphs(calls, iters_per_graph=10, reps=15, budget_ms=600.0)
                except Exception:  # the baseline is context: without it the layer is still timed
                    if "torch" not in calls:
                        raise
                    torch.cuda.empty_cache()
                    times = time_cuda_graphs({"fp4": fn}, iters_per_graph=10, reps=15, budget_ms=600.0)
                    row["timing"] = "alone (the joint timing with grouped_mm failed)"
            t = times["fp4"]
            bound = moe_bound_us(unique, H, I, fmt, float(ceilings["copy_gbs"]))
            flops = 2.0 * M * k * 3 * I * H
            row.update(us=t.median_us, unique_experts=unique, bound_us=bound, frac_weight_bound=bound / t.median_us,
                       tflops=flops / (t.median_us * 1e6), **monitor.summary())
            if "torch" in times:
                tt = times["torch"]
                row.update(torch_us=tt.median_us, speedup=tt.median_us / t.median_us)
        except Exception as err:  # a row that fails says so; the run goes on
            row["error"] = f"{type(err).__name__}: {one_line(str(err), 300)}"
        rows.append(row)
        _progress(console, row)
    return rows


def random_experts(E: int, H: int, I: int, fmt: str, gen, *, pack: bool = True):
    """Random stacked expert weights (w13 [E, 2I, H], w2 [E, H, I]) in ``fmt``, one global scale per
    expert, on ``gen``'s device; ``pack``: with their MMA-order copies made now (the W4A16 packed
    kernels read them; made before a CUDA graph is captured) where the rows are whole 16-row blocks."""
    import torch

    from ..quantize import quantize_stacked

    # built expert by expert (quantize_stacked) to bound the fp32 temporaries
    w13 = quantize_stacked(torch.randn(E, 2 * I, H, device=gen.device, dtype=torch.bfloat16, generator=gen), fmt)
    w2 = quantize_stacked(torch.randn(E, H, I, device=gen.device, dtype=torch.bfloat16, generator=gen), fmt)
    if pack and gen.device.type == "cuda" and (2 * I) % 16 == 0 and H % 16 == 0:
        from ..ops.moe import mma_packed_experts

        mma_packed_experts(w13)
        mma_packed_experts(w2)
    return w13, w2


def _zipf_bias(E: int, gen):
    import torch

    rank = torch.randperm(E, device="cuda", generator=gen).float()
    return -torch.log(rank + 1.0)  # logit bias log(1 / (rank + 1)): Zipf-like popularity


def _router(spec):
    """A function (logits, k0) -> (ids, weights, stats) from ``fp4moe.ops.routing``, or None."""
    try:
        from ..ops import routing as routing_ops
    except ImportError:
        return None
    make = getattr(routing_ops, "make_router", None)
    if make is None:
        return None
    return make(spec)


def _progress(console: Console, row: Mapping[str, Any]) -> None:
    label = f"moe {row['model']} M={row['M']:<5} {row['routing']:<7} oea={row['oea_k0']}"
    if row.get("error"):
        console.print(f"{label}: [red]{row['error']}[/red]")
        return
    torch_part = f", torch grouped_mm {row['torch_us']:.0f} µs" if row.get("torch_us") else ""
    console.print(f"{label}: {row['us']:.1f} µs, {row['unique_experts']} experts, "
                  f"{row['frac_weight_bound']:.0%} of the bound{torch_part}")
