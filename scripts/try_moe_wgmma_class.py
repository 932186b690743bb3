"""Prototype measurement (no library change): the GLM-5 MoE decode experts of 9-16 rows at 256
tokens (``ops.moe.MMAHeights``' tall class) on the SM90 wgmma grouped GEMMs (weights decoded into
the register A operand, the class's tokens as B from shared memory: no per-warp x loads, one wgmma
per 64 x 16 x 16) against the mma.sync 16-row launches the runtime uses. GEMM 1 with SwiGLU
writes h in GEMM 2's MMA K order (after a pass putting x into MMA K order, timed with it); GEMM 2
scatters bf16 pair rows. Tile maps from the runtime's ``tile_map``; times interleaved. GPU only.
Usage: PYTHONPATH=src python3 scripts/try_moe_wgmma_class.py [--tokens 256] [--out DIR]"""
import argparse
import json
import os
from dataclasses import replace

import torch

from fp4moe.ops import moe as moe_ops
from fp4moe.ops.dispatch import dispatch, tile_map
from fp4moe.ops.mma_layout import (KCHUNK, WgmmaConfig, launch_grouped_mma, launch_grouped_mma_swiglu,
                                   launch_grouped_wgmma, mma_order_rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256")
    ap.add_argument("--configs", default="16:4,16:6,16:3,32:4")
    ap.add_argument("--out")
    args = ap.parse_args()
    from fp4moe.bench.timing import time_cuda_graphs
    from moe_decode_setup import decode_experts

    ex = decode_experts()
    E, H, I, k, p13, p2, g13 = ex.E, ex.H, ex.I, ex.k, ex.p13, ex.p2, ex.g13
    g2 = moe_ops._weight_globals(ex.w2)
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x, ids, wts = ex.batch(T)
        heights = moe_ops.mma_moe_layer_config(T * k / E)
        cfg16, (lo, hi) = heights.classes()[1]
        plan = dispatch(ids, E, cfg16.block_m)
        pl16 = replace(plan, tiles=tile_map(plan, cfg16.block_m, (lo, hi)))
        R = T * k
        h = torch.empty(R, I, device="cuda", dtype=torch.bfloat16)
        row = dict(T=T, experts=int(((plan.expert_counts > lo) & (plan.expert_counts <= hi)).sum()), us={})

        def mma_g1():
            launch_grouped_mma_swiglu(x, p13, I, pl16, cfg16, h, g13, None)

        def mma_g2():
            launch_grouped_mma(h, p2, H, pl16, cfg16, gather=False, plan_ready=True)

        fns = {"mma g1": mma_g1, "mma g2": mma_g2}
        i_stored = p2.words.shape[1] * KCHUNK
        k_stored = p13.words.shape[1] * KCHUNK
        y_pair = torch.empty(R, H, device="cuda", dtype=torch.bfloat16)
        row_w = moe_ops._pair_weights(wts)[plan.sorted_pair.long()]
        h_mma = torch.zeros(R, i_stored, device="cuda", dtype=torch.bfloat16)
        for name in args.configs.split(","):
            bm, st = (int(v) for v in name.split(":"))
            c = WgmmaConfig(block_m=bm, stages=st, warps=4)
            plw = pl16 if bm == 16 else (lambda p: replace(p, tiles=tile_map(p, bm, (lo, hi))))(dispatch(ids, E, bm))
            xm = mma_order_rows(x, k_stored, plw.sorted_token)

            def w_g1(c=c, plw=plw):
                launch_grouped_wgmma(x, p13, 2 * I, plw, h_mma, c, gather=True, out_mma_order=True, swiglu=1,
                                     globals_=g13)

            def w_g1_only(c=c, plw=plw, xm=xm):  # x already in MMA K order: the GEMM alone
                launch_grouped_wgmma(xm, p13, 2 * I, plw, h_mma, c, gather=False, x_mma_order=True,
                                     out_mma_order=True, swiglu=1, globals_=g13)

            def w_g2(c=c, plw=plw):
                launch_grouped_wgmma(h_mma, p2, H, plw, y_pair, c, gather=False, x_mma_order=True, globals_=g2,
                                     row_weight=row_w, scatter=True)

            fns[f"wgmma{bm}s{st} g1+pass"] = w_g1
            fns[f"wgmma{bm}s{st} g1"] = w_g1_only
            fns[f"wgmma{bm}s{st} g2"] = w_g2
        for f in fns.values():
            f()
        torch.cuda.synchronize()
        res = {kk: vv.median_us for kk, vv in time_cuda_graphs(fns, iters_per_graph=10, reps=15).items()}
        row["us"] = res
        print(T, row["experts"], json.dumps({kk: round(vv, 1) for kk, vv in res.items()}), flush=True)
        rows.append(row)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(f"{args.out}/try-moe-wgmma-class-h200.json", "w") as f:
            json.dump(dict(about=__doc__.splitlines()[0], rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
