"""Benchmark of the public ``FP4MoE`` module as people call it: plain calls against the same calls in
a CUDA graph (``fp4moe bench calls``).

Per model preset and token count, one ``FP4MoE`` block (router, routing, experts and the shared
expert where the model has one, random weights, router weights of std 1/sqrt(H) so that the logits
are O(1)) is called on ``CALLS`` different inputs, timed together:

* ``graph_us``: the calls captured in one CUDA graph, the graph replayed (the GPU time of a call);
* ``plain_us``: plain calls, each its own Python call of the module, timed with CUDA events around
  the four (what an eager user waits for: the larger of host and GPU time), with the module's own
  graphs (``fp4moe.graphs``) as shipped;
* ``plain_no_graphs_us``: the same plain calls with the module's graphs turned off
  (``graph_policy(enabled=False)``): the A/B of what the graphs change, in the same process;
* ``host_us``: host time of one plain call (the Python loop of the four calls without the final
  synchronisation, over four).

``bound_us`` is the FP4 weight-read bound of the routed experts the four calls touch, per call
(their mean unique experts, ``bench.moe.moe_bound_us``), at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console

from .report import one_line

__all__ = ["CALLS", "DEFAULT_MODELS", "DEFAULT_MS", "random_block", "run_calls_bench"]

DEFAULT_MS: tuple[int, ...] = (1, 4, 16, 64, 256)
DEFAULT_MODELS: tuple[str, ...] = ("glm-5", "qwen3-30b-a3b")
CALLS = 4


def random_block(model: str, *, device="cuda", seed: int = 0):
    """An ``FP4MoE`` block with the shapes and routing of preset ``model`` and random weights."""
    import torch

    from ..models import get_model
    from ..nn import FP4Linear, FP4MoE, GatedMLP
    from ..quantize import quantize
    from .moe import random_experts

    spec = get_model(model)
    E, H, I = spec.n_experts, spec.hidden, spec.expert_intermediate
    gen = torch.Generator(device=device).manual_seed(seed)
    w13, w2 = random_experts(E, H, I, spec.fmt, gen, pack=False)
    router = (torch.randn(E, H, device=device, generator=gen) / H**0.5).to(torch.bfloat16)
    shared = None
    if spec.n_shared_experts:
        Is = I * spec.n_shared_experts

        def lin(n, k):
            return FP4Linear.from_fp4(quantize(torch.randn(n, k, device=device, generator=gen) / k**0.5, spec.fmt))

        shared = GatedMLP(lin(Is, H), lin(Is, H), lin(H, Is))
    kw = {}
    if spec.routing.kind == "sigmoid_bias":
        kw = dict(selection_bias=torch.zeros(E, device=device), router_dtype=torch.float32)
    return FP4MoE(router, w13, w2, spec.routing, shared_expert=shared, **kw).to(device)


def run_calls_bench(models: Sequence[str] = DEFAULT_MODELS, ms: Sequence[int] = DEFAULT_MS, *,
                    ceilings: Mapping[str, Any] | None = None, console: Console | None = None,
                    reps: int = 30) -> list[dict[str, Any]]:
    import torch

    from ..graphs import eager_calls, graph_policy
    from ..models import get_model
    from .linear import bench_ceilings
    from .moe import moe_bound_us
    from .timing import time_cuda_graph, time_plain_calls

    console = console or Console()
    ceilings = ceilings if ceilings is not None else bench_ceilings()
    rows: list[dict[str, Any]] = []
    for model in models:
        spec = get_model(model)
        block = random_block(model)
        gen = torch.Generator(device="cuda").manual_seed(1)
        for M in ms:
            row: dict[str, Any] = {"kind": "calls", "model": model, "M": M, "unique_experts": None, "bound_us": None,
                                   "graph_us": None, "plain_us": None, "host_us": None, "plain_no_graphs_us": None,
                                   "plain_over_graph": None, "no_graphs_over_graph": None, "graph_frac_bound": None,
                                   "plain_frac_bound": None, "error": None}
            try:
                xs = [torch.randn(1, M, spec.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
                      for _ in range(CALLS)]
                with torch.no_grad():
                    unique = []
                    for x in xs:
                        ids = block.route(x.reshape(M, -1)).topk_ids
                        unique.append(int(torch.unique(ids[ids >= 0]).numel()))
                row["unique_experts"] = sum(unique) / len(unique)
                row["bound_us"] = moe_bound_us(row["unique_experts"], spec.hidden, spec.expert_intermediate, spec.fmt,
                                               ceilings["copy_gbs"])

                def calls():
                    for x in xs:
                        block(x)

                with torch.no_grad():
                    calls()  # first calls: compile, guard probes, packs
                    with graph_policy(enabled=False):
                        row["plain_no_graphs_us"] = time_plain_calls(calls, reps=reps)[0].median_us / CALLS
                    calls()
                    calls()  # the module's graphs captured
                    stream, host = time_plain_calls(calls, reps=reps)
                    row["plain_us"], row["host_us"] = stream.median_us / CALLS, host.median_us / CALLS
                    with eager_calls():  # the timing's warm-up calls run on a side stream: no graphs of their own
                        timed = time_cuda_graph(calls, iters_per_graph=2, reps=20)
                    if not timed.graph:
                        raise RuntimeError("the four calls could not be captured in a CUDA graph")
                    row["graph_us"] = timed.median_us / CALLS
                g = row["graph_us"]
                row["plain_over_graph"] = row["plain_us"] / g
                row["no_graphs_over_graph"] = row["plain_no_graphs_us"] / g
                row["graph_frac_bound"] = row["bound_us"] / g
                row["plain_frac_bound"] = row["bound_us"] / row["plain_us"]
            except Exception as err:  # noqa: BLE001 - one row's failure is reported, the others run
                row["error"] = f"{type(err).__name__}: {one_line(str(err), 200)}"
            _progress(console, row)
            rows.append(row)
        block = None  # the next model's block is built in its memory
        torch.cuda.empty_cache()
    return rows


def _progress(console: Console, row: Mapping[str, Any]) -> None:
    label = f"calls {row['model']} M={row['M']:<4}"
    if row.get("error"):
        console.print(f"{label}: [red]{row['error']}[/red]")
        return
    console.print(f"{label}: bound {row['bound_us']:8.1f} µs  graph {row['graph_us']:8.1f}  plain {row['plain_us']:8.1f} "
                  f"({row['plain_over_graph']:.2f}x; host {row['host_us']:.1f})  without graphs "
                  f"{row['plain_no_graphs_us']:8.1f} ({row['no_graphs_over_graph']:.2f}x)")
