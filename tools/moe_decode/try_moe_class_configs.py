"""Measurement (no library change): other configurations for one tile class of the GLM-5 MoE decode
GEMMs (``ops.moe.MMAHeights``: ``--class 1`` the experts of more than 8 rows on 16-row tiles,
``--class 0`` the others), each GEMM timed interleaved with the runtime's configuration for that
class, outputs checked bitwise against it (configurations that change the K step order are
reported as not equal). GPU only.
Usage: PYTHONPATH=src python3 tools/moe_decode/try_moe_class_configs.py [--tokens 256] [--class 1]
       [--configs mma_n128_m16_k128_w4_xs2,...] [--out DIR]"""
import argparse
import json
import os
from dataclasses import replace

import torch

from fp4moe.ops import moe as moe_ops
from fp4moe.ops.dispatch import dispatch, tile_map
from fp4moe.ops.mma_sync import launch_grouped_mma, launch_grouped_mma_swiglu, MMAConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256")
    ap.add_argument("--class", dest="cls", type=int, default=1)
    ap.add_argument("--configs", default="mma_n128_m16_k128_w4_xs2,mma_n128_m16_k128_w4_xs3")
    ap.add_argument("--out")
    args = ap.parse_args()
    from fp4moe.bench.timing import time_cuda_graphs
    from moe_decode_setup import decode_experts

    ex = decode_experts()
    E, H, I, k, p13, p2, g13 = ex.E, ex.H, ex.I, ex.k, ex.p13, ex.p2, ex.g13
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x, ids, _ = ex.batch(T)
        heights = moe_ops.mma_moe_layer_config(T * k / E)
        base, rws = heights.classes()[args.cls]
        plan = dispatch(ids, E, heights.block_m)
        pl = replace(plan, tiles=tile_map(plan, base.block_m, rws))
        cfgs = {"base": base} | {n: MMAConfig.parse(n) for n in args.configs.split(",")}
        outs = {n: (torch.zeros(T * k, I, device="cuda", dtype=torch.bfloat16),
                    torch.zeros(1, T * k, H, device="cuda")) for n in cfgs}
        h_in = torch.randn(T * k, I, device="cuda").to(torch.bfloat16)  # GEMM 2's input, the same for all

        def g1(n):
            return lambda: launch_grouped_mma_swiglu(x, p13, I, pl, cfgs[n], outs[n][0], g13, None)

        def g2(n):
            return lambda: launch_grouped_mma(h_in, p2, H, pl, cfgs[n], gather=False, out=outs[n][1])

        for n in cfgs:
            g1(n)()
            g2(n)()
        torch.cuda.synchronize()
        equal = {n: bool(torch.equal(outs[n][0], outs["base"][0]) and torch.equal(outs[n][1], outs["base"][1]))
                 for n in cfgs}
        res = time_cuda_graphs({f"g{g} {n}": (g1 if g == 1 else g2)(n) for g in (1, 2) for n in cfgs},
                               iters_per_graph=10, reps=15)
        row = dict(T=T, cls=args.cls, base=str(base), bitwise=equal, us={kk: vv.median_us for kk, vv in res.items()})
        print(T, str(base), equal, {kk: round(vv, 1) for kk, vv in row["us"].items()}, flush=True)
        rows.append(row)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(f"{args.out}/try-moe-class-configs-c{args.cls}-h200.json", "w") as f:
            json.dump(dict(about=__doc__.splitlines()[0], rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
