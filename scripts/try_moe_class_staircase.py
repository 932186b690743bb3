"""Measurement (no library change): what one more expert costs in each tile class of the GLM-5 MoE
decode GEMMs at 256 tokens. Times GEMM 1 (fused SwiGLU) and GEMM 2 of one class
(``ops.moe.MMAHeights``: experts of at most 8 rows on 8-row tiles, the others on 16-row tiles) over
its first n experts, n stepped up to the whole class, with the tile map padded to the class's worst
case as the runtime's is. A time linear in n is the body's rate; steps at each full wave of
programs (slots = programs per SM x SMs) are the launch's tail. Also times the 16-row class with
its experts cut to exactly 9 or exactly 16 rows (the same weight bytes). Tile maps are built on the
host (a sync; only the GEMMs are timed). GPU only.
Usage: PYTHONPATH=src python3 scripts/try_moe_class_staircase.py [--tokens 256] [--step 4] [--out DIR]"""
import argparse
import json
import os
from dataclasses import replace

import torch

from fp4moe.ops import moe as moe_ops
from fp4moe.ops.dispatch import TileMap, dispatch
from fp4moe.ops.mma_layout import launch_grouped_mma, launch_grouped_mma_swiglu


def tiles_for(experts, counts, offsets, block_m, pad_to, device, rows=None):
    """A tile map over ``experts`` (every tile of each; ``rows`` caps each expert's rows), padded."""
    te, ts, tend = [], [], []
    for e in experts:
        c, o = counts[e], offsets[e]
        c = c if rows is None else min(c, rows)
        for s in range(0, c, block_m):
            te.append(e), ts.append(o + s), tend.append(o + min(c, s + block_m))
    n = len(te)
    pad = max(pad_to, n) - n
    i32 = dict(dtype=torch.int32, device=device)
    return TileMap(torch.tensor(te + [-1] * pad, **i32), torch.tensor(ts + [0] * pad, **i32),
                   torch.tensor(tend + [0] * pad, **i32), torch.tensor([n], **i32), block_m)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--step", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args()
    from fp4moe.bench.timing import time_cuda_graph
    from moe_decode_setup import decode_experts

    ex = decode_experts()
    E, H, I, k, p13, p2, g13 = ex.E, ex.H, ex.I, ex.k, ex.p13, ex.p2, ex.g13
    T = args.tokens
    x, ids, _ = ex.batch(T)
    heights = moe_ops.mma_moe_layer_config(T * k / E)
    assert isinstance(heights, moe_ops.MMAHeights), heights
    plan = dispatch(ids, E, heights.block_m)
    counts, offsets = plan.expert_counts.tolist(), plan.expert_offsets.tolist()
    h = torch.empty(T * k, I, device="cuda", dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # bytes of one expert's weights (packed words + scales) per GEMM
    b13 = (p13.words.numel() * p13.words.element_size() + p13.scales.numel() * p13.scales.element_size()) / E
    b2 = (p2.words.numel() * p2.words.element_size() + p2.scales.numel() * p2.scales.element_size()) / E
    out = dict(about=__doc__.splitlines()[0], tokens=T, sms=sms, bytes_per_expert=dict(gemm1=b13, gemm2=b2),
               classes=[])
    for cfg, (lo, hi) in heights.classes():
        members = [e for e in range(E) if lo < counts[e] <= hi]
        pad = T * k // cfg.block_m + E
        cls = dict(config=str(cfg), rows=(lo, min(hi, 1 << 20)), experts=len(members), points=[])
        ns = sorted(set(list(range(args.step, len(members), args.step)) + [len(members)]))
        variants = [(n, None) for n in ns]
        if lo >= 8:
            variants += [(len(members), 9), (len(members), 16)]
        for n, rows in variants:
            tm = tiles_for(members[:n], counts, offsets, cfg.block_m, pad, x.device, rows)
            pl = replace(plan, tiles=tm)
            g1 = lambda: launch_grouped_mma_swiglu(x, p13, I, pl, cfg, h, g13, None)  # noqa: E731
            g2 = lambda: launch_grouped_mma(h, p2, H, pl, cfg, gather=False, plan_ready=True)  # noqa: E731
            t1 = time_cuda_graph(g1, iters_per_graph=10, reps=10).median_us
            t2 = time_cuda_graph(g2, iters_per_graph=10, reps=10).median_us
            pt = dict(n=n, rows_cap=rows, gemm1_us=t1, gemm2_us=t2,
                      gemm1_gbs=n * b13 / t1 / 1e3, gemm2_gbs=n * b2 / t2 / 1e3)
            cls["points"].append(pt)
            print(cfg, pt, flush=True)
        out["classes"].append(cls)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(f"{args.out}/try-moe-class-staircase-h200.json", "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
