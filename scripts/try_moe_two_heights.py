"""Prototype measurement (no library change): the GLM-5 MoE decode GEMMs at 256 tokens with every
expert on 16-row tiles (the runtime's choice) against two launches per GEMM, experts of at most 8
rows on the 8-row configuration and the others on 16-row tiles. Tile maps are built on the host
here (a sync; the prototype only times the GEMMs), padded with idle tiles to each class's worst
case as a capturable version would be. GPU only.
Usage: PYTHONPATH=src python3 scripts/try_moe_two_heights.py [--tokens 256] [--out DIR]"""
import argparse
import json
import os
from dataclasses import replace

import torch

from fp4moe.ops import moe as moe_ops
from fp4moe.ops.dispatch import TileMap, dispatch
from fp4moe.ops.mma_layout import MMAConfig, launch_grouped_mma, launch_grouped_mma_swiglu


def class_tiles(counts, offsets, lo, hi, block_m, pad_to, device):
    """Tiles of block_m rows over the experts with lo < count <= hi, padded with idle tiles."""
    te, ts, tend = [], [], []
    for e, (c, o) in enumerate(zip(counts, offsets)):
        if lo < c <= hi:
            for s in range(0, c, block_m):
                te.append(e), ts.append(o + s), tend.append(o + min(c, s + block_m))
    n = len(te)
    pad = max(pad_to, n) - n
    te += [-1] * pad
    ts += [0] * pad
    tend += [0] * pad
    i32 = dict(dtype=torch.int32, device=device)
    return TileMap(torch.tensor(te, **i32), torch.tensor(ts, **i32), torch.tensor(tend, **i32),
                   torch.tensor([n], **i32), block_m), n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256")
    ap.add_argument("--split", type=int, default=8, help="experts with at most this many rows take 8-row tiles")
    ap.add_argument("--b-configs", default="mma_n128_m16_k128_w4,mma_n64_m16_k128_w4,mma_n64_m16_k256_w4,"
                                           "mma_n64_m16_k256_w2")
    ap.add_argument("--a-configs", default="mma_n64_m8_k256_w4")
    ap.add_argument("--b-maxnreg", default="", help="G1,G2: register caps for the 16-row launches (e.g. 128,80), "
                                                     "timed as extra variants of the first --b-configs entry")
    ap.add_argument("--out")
    args = ap.parse_args()
    from fp4moe.bench.timing import time_cuda_graph
    from moe_decode_setup import decode_experts

    ex = decode_experts()
    E, H, I, k, w13, w2, p13, p2, g13 = ex.E, ex.H, ex.I, ex.k, ex.w13, ex.w2, ex.p13, ex.p2, ex.g13
    res = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x, ids, wts = ex.batch(T)
        layer = lambda: moe_ops.moe_experts(x, w13, w2, ids, wts)  # noqa: E731
        t_layer = time_cuda_graph(layer, iters_per_graph=10, reps=10).median_us
        cfg16 = moe_ops.mma_moe_config(T * k / E)
        cfg8 = moe_ops.mma_moe_config(1)
        plan16 = dispatch(ids, E, cfg16.block_m)
        plan8 = dispatch(ids, E, cfg8.block_m)
        counts = plan16.expert_counts.tolist()
        offsets = plan16.expert_offsets.tolist()
        assert plan8.expert_offsets.tolist() == offsets
        n_small = sum(1 for c in counts if 0 < c <= args.split)
        n_big = sum(1 for c in counts if c > args.split)
        tm_a, na = class_tiles(counts, offsets, 0, args.split, cfg8.block_m, E, x.device)
        h = torch.empty(T * k, I, device="cuda", dtype=torch.bfloat16)

        def gemms(parts, unfused=()):
            for plan, cfg in parts:
                if cfg in unfused:  # timing only: GEMM 1's partial sums, no epilogue kernel (h not written)
                    launch_grouped_mma(x, p13, 2 * I, plan, cfg, gather=True)
                else:
                    launch_grouped_mma_swiglu(x, p13, I, plan, cfg, h, g13, None)
            return [launch_grouped_mma(h, p2, H, plan, cfg, gather=False, plan_ready=True) for plan, cfg in parts]

        base = [(plan16, cfg16)]
        ref_parts = gemms(base)
        h_ref = h.clone()
        t_base = time_cuda_graph(lambda: gemms(base), iters_per_graph=10, reps=10).median_us
        row = dict(T=T, layer_us=t_layer, experts_small=n_small, experts_big=n_big, base_config=str(cfg16),
                   base_gemms_us=t_base, variants=[])
        plan_a = replace(plan8, tiles=tm_a)
        row["small_only_us"] = {}
        for name in args.a_configs.split(","):
            cfg_a = MMAConfig.parse(name)
            t_a = time_cuda_graph(lambda: gemms([(plan_a, cfg_a)]), iters_per_graph=10, reps=10).median_us
            row["small_only_us"][name] = t_a
            print(T, "small only", name, t_a, flush=True)
        for name in args.b_configs.split(","):
            unf = name.endswith(":u")
            cfg_b = MMAConfig.parse(name.removesuffix(":u"))
            tm_b, nb = class_tiles(counts, offsets, args.split, 1 << 30, cfg_b.block_m,
                                   T * k // cfg_b.block_m + E, x.device)
            plan_b = replace(plan16, tiles=tm_b)
            two = [(plan_a, cfg8), (plan_b, cfg_b)]
            h.zero_()
            parts = gemms(two, (cfg_b,) if unf else ())
            # rows of each class from their own launch
            ok_h = None if unf else bool(torch.equal(h, h_ref))
            rows_a = torch.cat([torch.arange(ts, te) for ts, te, e in zip(tm_a.tile_start.tolist(),
                                tm_a.tile_end.tolist(), tm_a.tile_expert.tolist()) if e >= 0])
            err = max(float((parts[0][0][rows_a] - ref_parts[0][0][rows_a]).abs().max()), 0.0)
            uf = (cfg_b,) if unf else ()
            t_two = time_cuda_graph(lambda: gemms(two, uf), iters_per_graph=10, reps=10).median_us
            t_b = time_cuda_graph(lambda: gemms([(plan_b, cfg_b)], uf), iters_per_graph=10, reps=10).median_us
            v = dict(b_config=name, tiles_a=na, tiles_b=nb, h_equal=ok_h, part_a_maxdiff=err, two_us=t_two,
                     big_only_us=t_b, speedup=t_base / t_two)
            row["variants"].append(v)
            print(T, v, flush=True)
        if args.b_maxnreg:
            from fp4moe.kernels import linear_mma

            caps = [int(c) for c in args.b_maxnreg.split(",")]
            kernel = linear_mma.fp4_linear_mma_kernel

            class Capped:  # the 16-row launches compiled with a register cap (GEMM 1 fused: SWIGLU)
                def __getitem__(self, grid):
                    def launch(*a, **kw):
                        if kw.get("BLOCK_M") == 16:
                            kw["maxnreg"] = caps[0] if kw.get("SWIGLU") else caps[1]
                        return kernel[grid](*a, **kw)
                    return launch

            cfg_b = MMAConfig.parse(args.b_configs.split(",")[0].removesuffix(":u"))
            tm_b, nb = class_tiles(counts, offsets, args.split, 1 << 30, cfg_b.block_m, T * k // cfg_b.block_m + E,
                                   x.device)
            plan_b = replace(plan16, tiles=tm_b)
            two = [(plan_a, cfg8), (plan_b, cfg_b)]
            linear_mma.fp4_linear_mma_kernel = Capped()
            try:
                h.zero_()
                gemms(two)
                ok_h = bool(torch.equal(h, h_ref))
                t_two = time_cuda_graph(lambda: gemms(two), iters_per_graph=10, reps=10).median_us
                t_b = time_cuda_graph(lambda: gemms([(plan_b, cfg_b)]), iters_per_graph=10, reps=10).median_us
            finally:
                linear_mma.fp4_linear_mma_kernel = kernel
            v = dict(b_config=f"{cfg_b} maxnreg {args.b_maxnreg}", h_equal=ok_h, two_us=t_two, big_only_us=t_b,
                     speedup=t_base / t_two)
            row["variants"].append(v)
            print(T, v, flush=True)
        print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "variants"}), flush=True)
        res.append(row)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(f"{args.out}/try-moe-two-heights-h200.json", "w") as f:
            json.dump(dict(about=__doc__.splitlines()[0], rows=res), f, indent=1)


if __name__ == "__main__":
    main()
