"""The GLM-5 MoE decode layer (router logits -> routing -> dispatch -> the grouped mma.sync GEMMs ->
combine, under CUDA-graph replay) across the grouped kernel's configurations and GEMM 1's two
variants (partial sums + epilogue kernel, or the SwiGLU epilogue in the kernel), at 1..16 tokens:
what the heuristics ``ops.moe.mma_moe_config`` and ``FUSED_SWIGLU_MIN_PROGRAMS_PER_SM`` should pick.
Each configuration's output is checked against the default's first. GPU only
(it compiles ~24 Gluon kernels per batch: minutes); ``--dry-run`` lists the configurations (CPU).
``--configs mma_n64_m16_k256_w2:u,wgmma_n128_m16_s4_g8:f,...`` times only those (``:u`` unfused,
``:f`` fused GEMM 1), and
``--repeat R`` times every (batch, configuration, variant) R times, round-robin, so that a drift of
the GPU's clocks spreads over all of them instead of favouring the first.
Usage: PYTHONPATH=src python3 tools/sweep/sweep_moe_decode.py [--tokens 1,2,4] [--configs ...] [--repeat R] [--out DIR]
[--dry-run]"""
import argparse
import json
from dataclasses import replace

import torch

from fp4moe.ops import moe as moe_ops
from fp4moe.ops import moe_packed
from fp4moe.tuning import tuning
from fp4moe.ops.mma_sync import MMAConfig
from fp4moe.ops.wgmma import WgmmaConfig


def candidates(T: int, k: int, E: int) -> list[MMAConfig]:
    base = moe_ops.mma_moe_config(T * k / E)
    out = [base]
    for block_m in dict.fromkeys((base.block_m, 8)):
        for warps in (2, 4, 8):
            for rb in (1, 2):
                for kh in (2, 4):
                    out.append(replace(base, warps=warps, rb=rb, kh=kh, block_m=block_m))
    return list(dict.fromkeys(out))


def parse(name: str) -> tuple[MMAConfig | WgmmaConfig, bool]:
    """A configuration as the sweep prints it plus ``:u`` (GEMM 1 unfused) or ``:f`` (fused), e.g.
    ``mma_n128_m16_k128_w4:f`` or ``wgmma_n128_m16_s4_g8:f`` (the wgmma kernel's GEMM 1 always fuses
    the activation) -> (configuration, fused)."""
    cfg, _, variant = name.partition(":")
    try:
        config = WgmmaConfig.parse(cfg) if cfg.startswith("wgmma_") else MMAConfig.parse(cfg)
    except ValueError as err:
        raise SystemExit(f"--configs: {err}") from None
    if variant not in ("u", "f") or (isinstance(config, WgmmaConfig) and variant != "f"):
        raise SystemExit(f"--configs: expected a configuration name then :u or :f (wgmma: :f), got {name!r}")
    return config, variant == "f"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--out")
    ap.add_argument("--configs", help="comma-separated configuration names with :u or :f (default: the candidates "
                                      "x both)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    from fp4moe.models import get_model

    spec = get_model("glm-5")
    E, H, I, k = spec.n_experts, spec.hidden, spec.expert_intermediate, spec.routing.top_k
    def runs(T: int) -> list[tuple[MMAConfig, bool]]:
        if args.configs:
            return [parse(c) for c in args.configs.split(",")]
        return [(cfg, fused) for cfg in candidates(T, k, E) for fused in (False, True)]

    if args.dry_run:
        for T in tokens:
            print(T, [f"{c}:{'f' if f else 'u'}" for c, f in runs(T)])
        return

    from fp4moe.bench.moe import ROUTING_SETS, _router, random_experts
    from fp4moe.bench.timing import rotating, time_cuda_graph

    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, w2 = random_experts(E, H, I, spec.fmt, gen)
    route = _router(spec)
    default_cfg, default_wgmma = moe_packed.mma_moe_config, moe_packed.wgmma_moe_config
    res = []
    for T in tokens:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        # as fp4moe bench moe: the timed graph cycles through routings (consecutive calls, other experts)
        sets = [(torch.randn(T, E, device="cuda", dtype=torch.float32, generator=gen),) for _ in range(ROUTING_SETS)]
        one = lambda logits: moe_ops.moe_experts(x, w13, w2, *route(logits, None)[:2])  # noqa: E731
        ref = one(*sets[0]).float()
        for rep, (cfg, fused) in ((r, c) for r in range(args.repeat) for c in runs(T)):
            if isinstance(cfg, WgmmaConfig):  # every batch on the wgmma kernel
                changes = dict(wgmma_min_rows=0)
                moe_packed.wgmma_moe_config = lambda rows, c=cfg: c
            else:
                changes = dict(fused_swiglu_min_programs_per_sm=0 if fused else float("inf"))
                moe_packed.mma_moe_config = lambda rows, c=cfg: c
            try:
                with tuning(moe=changes):
                    err = float(((one(*sets[0]).float() - ref).abs().max() / ref.abs().max()))
                    us = time_cuda_graph(rotating(one, sets), iters_per_graph=10, reps=10).median_us \
                        if err < 2e-2 else None
                row = dict(T=T, config=str(cfg), fused=fused, rep=rep, us=us, rel_err=err)
            except Exception as exc:  # a configuration that does not compile or launch
                row = dict(T=T, config=str(cfg), fused=fused, rep=rep, us=None, error=repr(exc)[:300])
            finally:
                moe_packed.mma_moe_config, moe_packed.wgmma_moe_config = default_cfg, default_wgmma
            res.append(row)
            print(row, flush=True)
    if args.out:
        name = "sweep-moe-decode-h200" + ("-configs" if args.configs else "")
        with open(f"{args.out}/{name}.json", "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
