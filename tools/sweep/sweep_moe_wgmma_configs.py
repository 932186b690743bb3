"""GLM-5 MoE prefill on SM90 with named wgmma configurations for GEMM 1 and GEMM 2 (``ops.moe``'s
``wgmma_moe_config`` and ``wgmma_gemm2_config`` replaced while each graph is captured, so every
graph keeps its own), the layer's experts (dispatch..combine) timed with all variants' replays
interleaved (``time_cuda_graphs``: the same clocks, which matter at the 700 W cap). Each variant is
checked first on a small layer against the reference and on the GLM-5 layer against the default.
A variant is ``G1`` or ``G1+G2`` (``WgmmaConfig`` names; GEMM 2 must keep GEMM 1's block_m and
tail_m, the plan's tiles); ``default`` is the runtime's choice. GPU only (SM90).
``--routing zipf`` adds the bench's Zipf-like logit bias (``bench.moe._zipf_bias``) to the router
logits: a few experts take most rows, the rest few.
Usage: PYTHONPATH=src python3 tools/sweep/sweep_moe_wgmma_configs.py --variants default,wgmma_n128_m128_s5_g8_t32
[--tokens 4096] [--routing uniform|zipf] [--out DIR]"""
import argparse
import json
import os

import torch

from fp4moe.ops import moe as moe_ops
from fp4moe.ops import moe_packed
from fp4moe.ops.wgmma import WgmmaConfig

_G1, _G2 = moe_packed.wgmma_moe_config, moe_packed.wgmma_gemm2_config


def patched(variant: str, fn):
    """``fn`` run with ``variant``'s configurations in place of the heuristic's."""
    if variant == "default":
        return fn
    names = variant.split("+")
    g1 = WgmmaConfig.parse(names[0])
    g2 = WgmmaConfig.parse(names[1]) if len(names) > 1 else None
    if g2 is not None and (g2.block_m, g2.tail_m) != (g1.block_m, g1.tail_m):
        raise SystemExit(f"{variant}: GEMM 2 must keep GEMM 1's block_m and tail_m (the plan's tiles)")

    def run():
        moe_packed.wgmma_moe_config = lambda rows_per_expert: g1
        if g2 is not None:
            moe_packed.wgmma_gemm2_config = lambda cfg: g2
        try:
            return fn()
        finally:
            moe_packed.wgmma_moe_config, moe_packed.wgmma_gemm2_config = _G1, _G2
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", required=True)
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--routing", choices=("uniform", "zipf"), default="uniform")
    ap.add_argument("--out")
    args = ap.parse_args()
    variants = ["default"] + [v for v in args.variants.split(",") if v != "default"]

    from fp4moe.bench.moe import _zipf_bias, random_experts
    from fp4moe.bench.timing import ClockMonitor, time_cuda_graphs
    from fp4moe.models import get_model
    from fp4moe.ops.routing import make_router

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "routing": args.routing, "checks": [],
           "time": []}
    p = moe_ops.random_moe_problem(2000, 64, 8, 1024, 512, "nvfp4", device="cuda", seed=7, dropped=(0, 7))
    ref = moe_ops.fp4_moe_reference(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights).float()
    ok_variants = []
    for v in variants:
        try:
            y = patched(v, lambda: moe_ops.fp4_moe_experts(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights))().float()
            err = float((y - ref).abs().max() / ref.abs().max())
        except Exception as e:  # noqa: BLE001 - a sweep records what fails and goes on
            print(f"{v}: failed {e!r:.300}", flush=True)
            res["checks"].append(dict(variant=v, error=repr(e)[:300]))
            continue
        res["checks"].append(dict(variant=v, rel_err=err, ok=err < 2e-2))
        print(f"check {v}: rel_err {err:.2e}", flush=True)
        if err < 2e-2:
            ok_variants.append(v)
    spec = get_model("glm-5")
    E, H = spec.n_experts, spec.hidden
    w13, w2 = random_experts(E, H, spec.expert_intermediate, spec.fmt, torch.Generator(device="cuda").manual_seed(0))
    route = make_router(spec)
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(T, E, device="cuda")
        if args.routing == "zipf":
            logits = logits + _zipf_bias(E, torch.Generator(device="cuda").manual_seed(T))
        ids, wts, _ = route(logits)
        fns = {v: patched(v, lambda: moe_ops.fp4_moe_experts(x, w13, w2, ids, wts)) for v in ok_variants}
        base = fns["default"]().float()
        counts = torch.bincount(ids.flatten().long(), minlength=E)  # rows per expert
        row = dict(T=T, active_experts=int((counts > 0).sum()),
                   experts_129_160=int(((counts > 128) & (counts <= 160)).sum()))  # those a merged tile covers
        for v, fn in fns.items():
            row[f"{v}_vs_default"] = float((fn().float() - base).abs().max() / base.abs().max())
        with ClockMonitor() as mon:
            t = time_cuda_graphs(fns, iters_per_graph=3, reps=9)
        row.update({f"{v}_us": r.median_us for v, r in t.items()}, **mon.summary())
        res["time"].append(row)
        print(f"T={T} ({args.routing}): {row['active_experts']} experts with rows, {row['experts_129_160']} with "
              f"129-160", flush=True)
        for v in fns:
            print(f"T={T} {v}: {row[f'{v}_us']:.1f} us ({row['default_us'] / row[f'{v}_us']:.3f}x default), "
                  f"vs default {row[f'{v}_vs_default']:.1e}", flush=True)
    if args.out:
        with open(os.path.join(args.out, "sweep-moe-wgmma-configs-h200.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
