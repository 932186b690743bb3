"""The GLM-5 MoE decode layer (router logits -> routing -> dispatch -> the grouped mma.sync GEMMs ->
combine, under CUDA-graph replay) across the grouped kernel's configurations and GEMM 1's two
variants (partial sums + epilogue kernel, or the SwiGLU epilogue in the kernel), at 1..16 tokens:
what the heuristics ``ops.moe.mma_moe_config`` and ``FUSED_SWIGLU_MIN_PROGRAMS_PER_SM`` should pick.
Session 10 measured only the defaults: one token 59.0 us unfused against 63.1 fused, four tokens
188.9 against 181.3. Each configuration's output is checked against the default's first. GPU only
(not yet run: written at the end of session 10 with no GPU time left; it compiles ~24 Gluon
kernels, minutes, so start with ``--tokens 1,4``); ``--dry-run`` lists the configurations (CPU).
Usage: PYTHONPATH=src python3 scripts/sweep_moe_decode.py [--tokens 1,2,4] [--out DIR] [--dry-run]"""
import argparse
import json
from dataclasses import replace

import torch

from fp4moe.ops import moe as moe_ops
from fp4moe.ops.mma_layout import MMAConfig


def candidates(T: int, k: int, E: int) -> list[MMAConfig]:
    base = moe_ops.mma_moe_config(T * k / E)
    out = [base]
    for block_m in dict.fromkeys((base.block_m, 8)):
        for warps in (2, 4, 8):
            for rb in (1, 2):
                for kh in (2, 4):
                    out.append(replace(base, warps=warps, rb=rb, kh=kh, block_m=block_m))
    return list(dict.fromkeys(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--out")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    from fp4moe.models import get_model

    spec = get_model("glm-5")
    E, H, I, k = spec.n_experts, spec.hidden, spec.expert_intermediate, spec.routing.top_k
    if args.dry_run:
        for T in tokens:
            print(T, [str(c) for c in candidates(T, k, E)])
        return

    from fp4moe.bench.moe import _router
    from fp4moe.bench.timing import time_cuda_graph
    from fp4moe.quantize import quantize_stacked

    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = quantize_stacked(torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen), spec.fmt)
    w2 = quantize_stacked(torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=gen), spec.fmt)
    route = _router(spec)
    default_cfg, default_min = moe_ops.mma_moe_config, moe_ops.FUSED_SWIGLU_MIN_PROGRAMS_PER_SM
    res = []
    for T in tokens:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(T, E, device="cuda", dtype=torch.float32, generator=gen)
        layer = lambda: moe_ops.moe_experts(x, w13, w2, *route(logits, None)[:2])  # noqa: E731
        ref = layer().float()
        for cfg in candidates(T, k, E):
            for fused in (False, True):
                moe_ops.mma_moe_config = lambda rows, c=cfg: c
                moe_ops.FUSED_SWIGLU_MIN_PROGRAMS_PER_SM = 0 if fused else float("inf")
                try:
                    err = float(((layer().float() - ref).abs().max() / ref.abs().max()))
                    us = time_cuda_graph(layer, iters_per_graph=10, reps=10).median_us if err < 2e-2 else None
                    row = dict(T=T, config=str(cfg), fused=fused, us=us, rel_err=err)
                except Exception as exc:  # a configuration that does not compile or launch
                    row = dict(T=T, config=str(cfg), fused=fused, us=None, error=repr(exc)[:300])
                finally:
                    moe_ops.mma_moe_config, moe_ops.FUSED_SWIGLU_MIN_PROGRAMS_PER_SM = default_cfg, default_min
                res.append(row)
                print(row, flush=True)
    if args.out:
        with open(f"{args.out}/sweep-moe-decode-h200.json", "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
