"""GPU sweep of fp4_linear configurations (development tool; the heuristic is set from its output).

Usage on a GPU machine: PYTHONPATH=src FP4MOE_GUARD=0 python tools/sweep/sweep_linear.py [--quick] [--out DIR]
Prints, per shape and M, each configuration's time and its fraction of the FP4 weight-read bound
(weight + scale bytes / copy bandwidth measured in the same run); writes JSON to --out.
"""

import argparse
import itertools
import json
import os

import torch

import fp4moe
from fp4moe.target.roofline import fp4_weight_bytes
from fp4moe.bench.timing import l2_bytes, measure_copy_bandwidth, rotating, rotation_count, time_cuda_graph
from fp4moe.ops.linear import LinearConfig, choose_config, fp4_linear, fp4_linear_reference

SHAPES = [(12288, 6144), (6144, 12288), (4096, 6144), (6144, 2048)]


def weight_sets(N, K, fmt, l2):
    w = fp4moe.quantize(torch.randn(N, K, device="cuda"), fmt)
    n = rotation_count(w.nbytes, l2)
    return [w] + [fp4moe.FP4Tensor(w.data.clone(), w.scales.clone(), w.global_scale, w.shape, w.fmt) for _ in range(n - 1)]


def time_config(x, sets, cfg, mode):
    fn = rotating(lambda w: fp4_linear(x, w, mode=mode, config=cfg), [(w,) for w in sets])
    return time_cuda_graph(fn, iters_per_graph=len(sets) * max(1, 20 // len(sets)), reps=15).median_us


def check(cfg, M, N, K, fmt, mode):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = fp4moe.quantize(torch.randn(N, K, device="cuda"), fmt)
    y = fp4_linear(x, w, mode=mode, config=cfg).float()
    r = fp4_linear_reference(x, w, mode=mode).float()
    return ((y - r).abs().max() / r.abs().max()).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--ms", default="1,16,64")
    p.add_argument("--prefill", default="4096")
    args = p.parse_args()
    torch.manual_seed(0)
    bw = measure_copy_bandwidth()
    l2 = l2_bytes()
    print(f"copy bandwidth {bw:.0f} GB/s, L2 {l2 / 2**20:.0f} MiB")
    results = {"copy_gbs": bw, "rows": []}
    decode = [LinearConfig(64, 16, bk, 4, st, sk) for bk, st, sk in itertools.product((128, 256), (1, 4), (2, 4, 8))]
    prefill = [LinearConfig(128, 128, 64, 8, 3), LinearConfig(128, 256, 64, 8, 3)]
    if args.quick:
        decode, prefill = decode[:4], prefill[:2]
    for N, K in SHAPES:
        sets = weight_sets(N, K, "nvfp4", l2)
        bound_us = fp4_weight_bytes(N, K, "nvfp4") / bw * 1e-3
        for M in [int(m) for m in args.ms.split(",")]:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            cands = [LinearConfig(c.block_n, 16 if M <= 16 else (32 if M <= 32 else 64), c.block_k, c.num_warps,
                                  c.num_stages, c.split_k) for c in decode]
            cands.append(choose_config(M, N, K, path="w4a16", arch=None, sm_count=132))
            best = None
            for cfg in dict.fromkeys(cands):
                try:
                    err = check(cfg, M, N, K, "nvfp4", "w4a16")
                    us = time_config(x, sets, cfg, "w4a16")
                except Exception as e:  # noqa: BLE001 - a sweep reports and continues
                    print(f"{N}x{K} M={M} {cfg}: ERROR {type(e).__name__}: {str(e)[:200]}")
                    continue
                frac = bound_us / us
                results["rows"].append({"N": N, "K": K, "M": M, "config": str(cfg), "us": us, "bound_us": bound_us,
                                        "fraction": frac, "max_rel_err": err})
                if best is None or us < best[1]:
                    best = (cfg, us, frac)
            print(f"{N}x{K} M={M}: bound {bound_us:.2f} us, best {best[0]} {best[1]:.2f} us = {best[2]:.0%}")
        for M in [int(m) for m in args.prefill.split(",") if m]:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            wb = fp4moe.dequantize(sets[0], torch.bfloat16)
            t_torch = time_cuda_graph(lambda: x @ wb.t(), iters_per_graph=5, reps=10).median_us
            for cfg in prefill + [choose_config(M, N, K, path="w4a16", arch=None, sm_count=132)]:
                try:
                    err = check(cfg, 512, N, K, "nvfp4", "w4a16")
                    us = time_config(x, sets[:2], cfg, "w4a16")
                except Exception as e:  # noqa: BLE001
                    print(f"{N}x{K} M={M} {cfg}: ERROR {type(e).__name__}: {str(e)[:200]}")
                    continue
                tf = 2 * M * N * K / us * 1e-6
                results["rows"].append({"N": N, "K": K, "M": M, "config": str(cfg), "us": us, "torch_us": t_torch,
                                        "tflops": tf, "max_rel_err": err})
                print(f"{N}x{K} M={M} {cfg}: {us:.1f} us ({tf:.0f} TFLOP/s), torch bf16 {t_torch:.1f} us, err {err:.2e}")
    with open(os.path.join(args.out, "sweep_linear.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
