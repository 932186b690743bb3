"""MoE prefill on SM90 (ops.moe._run_wgmma): the experts' short last tiles (<= 64 rows) run with 64-row
wgmmas (``WgmmaConfig.tail_m``; GEMM 1 only or both GEMMs) or as full 128-row tiles, ring depth 4 or 5:
correctness against the reference, then GLM-5 layer times (experts: dispatch..combine) and the
routing alone, with CUDA graphs. GPU only (SM90). At 1024 tokens (32 rows per expert) the runtime
picks 64-row tiles, which no variant changes: those columns time one configuration repeatedly and
show the measurement's spread.
Usage: PYTHONPATH=src python3 scripts/sweep_moe_tails.py [--out DIR]
(benchmarks/raw/sweep-moe-tails-split-h200.json is an earlier version, commit e6ec365, that ran
the tails as a second launch and tried GEMM 2 on two warpgroups of one repeat.)"""
import argparse
import json
import os
from dataclasses import replace

import torch

from fp4moe.bench.timing import time_cuda_graph
from fp4moe.models import get_model
from fp4moe.ops import moe as moe_ops
from fp4moe.ops.routing import make_router
from fp4moe.quantize import quantize, quantize_stacked

VARIANTS = [(0, False, 4), (64, False, 4), (64, True, 4), (64, False, 5)]  # (tail_m, GEMM 2 too, stages)
_HEURISTIC = moe_ops.wgmma_moe_config


def set_variant(tail, gemm2, stages):
    """The runtime's choice with 128-row tiles' tail_m (GEMM 1, and GEMM 2 when gemm2) and ring depth."""
    def config(rows_per_expert):
        c = _HEURISTIC(rows_per_expert)
        return c if c.block_m < 128 else replace(c, tail_m=tail, stages=stages)
    moe_ops.wgmma_moe_config = config
    moe_ops._GEMM2_TAILS = gemm2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    dev = "cuda"
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": [], "time": []}
    for T, E, k, H, I, fmt in [(700, 16, 4, 512, 256, "nvfp4"), (512, 8, 2, 256, 128, "mxfp4"),
                               (2000, 64, 8, 1024, 512, "nvfp4")]:
        p = moe_ops.random_moe_problem(T, E, k, H, I, fmt, device=dev, seed=T, dropped=(0, k - 1))
        ref = moe_ops.fp4_moe_reference(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights).float()
        for v in VARIANTS:
            set_variant(*v)
            y = moe_ops.fp4_moe_experts(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights)
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            res["checks"].append(dict(T=T, E=E, k=k, H=H, I=I, fmt=fmt, variant=v, rel_err=err, ok=err < 2e-2))
            print("check", T, E, k, H, I, fmt, v, f"{err:.2e}", "OK" if err < 2e-2 else "FAIL", flush=True)
    model = get_model("glm-5")
    E, k, H, I = 256, 8, 6144, 2048
    w13 = quantize_stacked(torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16), "nvfp4")
    w2 = quantize(torch.randn(E, H, I, device=dev, dtype=torch.bfloat16), "nvfp4")
    moe_ops.mma_packed_experts(w13)
    moe_ops.mma_packed_experts(w2)
    route = make_router(model)
    for T in (1024, 4096, 16384):
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        logits = torch.randn(T, E, device=dev)
        ids, wts, _ = route(logits)
        row = dict(T=T, route_us=time_cuda_graph(lambda: route(logits), iters_per_graph=10, reps=10).median_us)
        for v in VARIANTS:
            set_variant(*v)
            row[f"tail{v[0]}{'_both' if v[1] else ''}_s{v[2]}"] = time_cuda_graph(
                lambda: moe_ops.fp4_moe_experts(x, w13, w2, ids, wts), iters_per_graph=3, reps=7).median_us
        print("glm-5", " ".join(f"{a}={b:.1f}" if isinstance(b, float) else f"{a}={b}" for a, b in row.items()),
              flush=True)
        res["time"].append(row)
    if args.out:
        with open(os.path.join(args.out, "sweep-moe-tails-h200.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
