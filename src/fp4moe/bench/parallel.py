"""Benchmark of one MoE layer split over the ranks of a ``torch.distributed`` job
(``torchrun ... -m fp4moe.cli bench moe --tp N --ep N``): per rank, the whole call, the local
experts' compute alone, what the difference costs (communication, dispatch and waiting), and the
imbalance between ranks.

Each rank builds only its own experts (random FP4 weights of the preset's shapes: its
``ExpertPlacement`` share, before its tensor-parallel cut), the router whole, and times
``ParallelFP4MoE`` plain calls (no CUDA graph: the collectives run as a user's eager call runs
them) on its tokens: ``tokens`` per rank, the same tokens on every rank for the ``replicated``
dispatch. The compute time is the rank's ``moe_experts`` call on exactly the rows and pairs the
dispatch handed it, timed alone; ``other_us`` = call - compute. Ranks start every repetition
together (a barrier), so a slow rank shows as waiting in the others' ``other_us``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["run_parallel_moe_bench"]


def run_parallel_moe_bench(model: str = "glm-5", *, tp: int = 1, ep: int = 1, dispatch: str = "all_gather",
                           tokens: Sequence[int] = (1, 16, 64, 256), mode: str = "w4a16", reps: int = 20,
                           warmup: int = 3, seed: int = 0, shapes: dict[str, int] | None = None,
                           device=None) -> list[dict[str, Any]]:
    """Rows per token count (module docstring); every rank gets all rows (the same list).

    ``shapes`` overrides the preset's ``n_experts``, ``hidden``, ``intermediate`` (small layers for
    tests); ``device``: default this rank's CUDA device, else CPU.
    """
    import torch
    import torch.distributed as dist

    from ..distributed import BlockParts, ExpertPlacement, ParallelFP4MoE, make_groups
    from ..models import get_model
    from ..quantize import quantize_stacked
    from .timing import time_plain_calls

    if not dist.is_initialized():
        raise RuntimeError("bench moe --tp/--ep: run it under torchrun (torch.distributed is not initialized)")
    spec = get_model(model)
    shapes = shapes or {}
    E, H = shapes.get("n_experts", spec.n_experts), shapes.get("hidden", spec.hidden)
    I = shapes.get("intermediate", spec.expert_intermediate)
    fmt = spec.fmt if mode == "w4a16" else "nvfp4"
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    groups = make_groups(tp, ep)
    placement = ExpertPlacement.contiguous(E, ep)
    owned = placement.owners[groups.ep_rank]
    gen = torch.Generator(device=device).manual_seed(seed)  # the same router on every rank
    router = torch.randn(E, H, device=device, dtype=torch.bfloat16, generator=gen) / H ** 0.5
    gen.manual_seed(seed + 1 + groups.ep_rank)  # this rank's experts only
    w13 = quantize_stacked(torch.randn(len(owned), 2 * I, H, device=device, generator=gen) / H ** 0.5, fmt)
    w2 = quantize_stacked(torch.randn(len(owned), H, I, device=device, generator=gen) / I ** 0.5, fmt)
    parts = BlockParts(router, w13, w2, spec.routing, expert_ids=owned, mode=mode,
                       router_dtype=torch.float32 if spec.routing.kind == "sigmoid_bias" else None)
    layer = ParallelFP4MoE(parts, groups, placement=placement, dispatch=dispatch)
    del w13, w2, parts
    seen: list[tuple] = []
    local = layer._local

    def recording(*args):  # what the dispatch hands the rank's experts
        seen[:] = [args]
        return local(*args)

    def time_us(fn, reps: int) -> float:  # each repetition started by a barrier: all ranks together
        return time_plain_calls(fn, calls=1, reps=reps, before=dist.barrier, device=device)[0].median_us

    rows = []
    for T in tokens:
        row: dict[str, Any] = {"kind": "moe-parallel", "model": model, "tp": tp, "ep": ep, "dispatch": dispatch,
                               "mode": mode, "tokens_per_rank": T, "call_us": None, "compute_us": None,
                               "other_us": None, "imbalance": None, "rows_computed": None}
        # no per-row error capture: a rank that failed would leave the others waiting in a collective
        gen.manual_seed(seed + 1000 + T + (0 if dispatch == "replicated" else groups.ep_rank))
        x = torch.randn(T, H, device=device, dtype=torch.bfloat16, generator=gen)
        try:
            layer._local = recording
            with torch.inference_mode():
                for _ in range(warmup):
                    layer(x)
                layer._local = local
                call = time_us(lambda: layer(x), reps)
                args = seen[0]
                compute = time_us(lambda: local(*args), reps)
        finally:
            layer._local = local
        mine = torch.tensor([call, compute, float(args[0].shape[0])], dtype=torch.float64, device=device)
        every = torch.empty(dist.get_world_size() * 3, dtype=torch.float64, device=device)
        dist.all_gather_into_tensor(every, mine)
        every = every.view(-1, 3).cpu()
        computes = every[:, 1]
        row.update(call_us=float(every[:, 0].max()), compute_us=float(computes.max()),
                   other_us=float((every[:, 0] - every[:, 1]).max()),
                   imbalance=float(computes.max() / computes.mean()), rows_computed=int(every[:, 2].max()),
                   per_rank=[{"call_us": float(c), "compute_us": float(p), "rows": int(r)} for c, p, r in every])
        rows.append(row)
    return rows
