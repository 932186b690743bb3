"""MoE prefill on SM90 (ops.moe._run_wgmma): GEMM 2's pair rows in fp32 or bf16
(``ops.moe.PAIR_ROWS_DTYPE``, what the combine reads back) and the experts' short last tiles on
32- or 64-row wgmmas (``WgmmaConfig.tail_m``) in GEMM 1 only or in both GEMMs
(``ops.moe._GEMM2_TAILS``). Correctness against the reference on small layers, then GLM-5 layer
times (experts: dispatch..combine) at 1024, 4096 and 16384 tokens with CUDA graphs, and the
per-kernel split at 4096 tokens. GPU only (SM90).
Usage: PYTHONPATH=src python3 scripts/sweep_moe_prefill.py [--out DIR]"""
import argparse
import json
import os
from dataclasses import replace

import torch

from fp4moe.bench.timing import kernel_times, time_cuda_graph
from fp4moe.ops import moe as moe_ops
from fp4moe.quantize import quantize, quantize_stacked

# (GEMM 1 tail_m, GEMM 2 tails too, pair-row dtype); the first is session 7's layer
VARIANTS = [(64, False, torch.float32), (64, False, torch.bfloat16), (64, True, torch.bfloat16),
            (32, False, torch.bfloat16), (32, True, torch.bfloat16)]
_HEURISTIC = moe_ops.wgmma_moe_config


def set_variant(tail, gemm2, dtype):
    def config(rows_per_expert):
        c = _HEURISTIC(rows_per_expert)
        return replace(c, tail_m=tail) if c.block_m == 128 else c
    moe_ops.wgmma_moe_config = config
    moe_ops._GEMM2_TAILS = gemm2
    moe_ops.PAIR_ROWS_DTYPE = dtype


def name(v) -> str:
    return f"tail{v[0]}{'_both' if v[1] else ''}_{str(v[2]).replace('torch.', '')}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--variants", default=None, help="indices into VARIANTS, e.g. 2,4 (default: all)")
    args = ap.parse_args()
    global VARIANTS
    if args.variants:
        VARIANTS = [VARIANTS[int(i)] for i in args.variants.split(",")]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": [], "time": [],
           "kernels": {}}
    for T, E, k, H, I, fmt in [(700, 16, 4, 512, 256, "nvfp4"), (512, 8, 2, 256, 128, "mxfp4"),
                               (2000, 64, 8, 1024, 512, "nvfp4")]:
        p = moe_ops.random_moe_problem(T, E, k, H, I, fmt, device="cuda", seed=T, dropped=(0, k - 1))
        ref = moe_ops.fp4_moe_reference(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights).float()
        for v in VARIANTS:
            set_variant(*v)
            y = moe_ops.fp4_moe_experts(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights)
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            same = bool(torch.equal(y, moe_ops.fp4_moe_experts(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights)))
            ok = err < 2e-2 and same
            res["checks"].append(dict(T=T, E=E, k=k, H=H, I=I, fmt=fmt, variant=name(v), rel_err=err, same=same,
                                      ok=ok))
            print("check", T, E, k, H, I, fmt, name(v), f"{err:.2e}", "OK" if ok else "FAIL", flush=True)
    E, k, H, I = 256, 8, 6144, 2048
    w13 = quantize_stacked(torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16), "nvfp4")
    w2 = quantize(torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16), "nvfp4")
    from fp4moe.models import get_model
    from fp4moe.ops.routing import make_router
    route = make_router(get_model("glm-5"))
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        ids, wts, _ = route(torch.randn(T, E, device="cuda"))
        row = dict(T=T)
        for v in VARIANTS:
            set_variant(*v)
            def fn():
                return moe_ops.fp4_moe_experts(x, w13, w2, ids, wts)
            row[name(v)] = time_cuda_graph(fn, iters_per_graph=3, reps=7).median_us
            if T == 4096:
                res["kernels"][name(v)] = kernel_times(fn, calls=3)
        print("glm-5", " ".join(f"{a}={b:.1f}" if isinstance(b, float) else f"{a}={b}" for a, b in row.items()),
              flush=True)
        res["time"].append(row)
    for v, kt in res["kernels"].items():
        print("kernels", v, " | ".join(f"{n[:40]} {t:.0f}" for n, t in sorted(kt.items(), key=lambda a: -a[1])[:6]))
    if args.out:
        with open(os.path.join(args.out, f"sweep-moe-prefill-{args.tokens.replace(',', '-')}-h200.json"), "w") as f:
            json.dump(res, f, indent=1)
    print("checks failed:", sum(not r["ok"] for r in res["checks"]))


if __name__ == "__main__":
    main()
