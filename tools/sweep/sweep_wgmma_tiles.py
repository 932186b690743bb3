"""Tile shapes of the Hopper prefill kernel (kernels/gemm_wgmma.py) on the GLM-5 linear shapes:
correctness of each configuration against the reference, then times against torch bf16 ``matmul``
in the same run. GPU only (SM90).
Usage: PYTHONPATH=src python3 tools/sweep/sweep_wgmma_tiles.py [--out DIR] [--ms 1024,4096,16384]
  [--shapes NxK,...] [--mid | --depth | --ws | --persistent]   (--ws: the warp-specialized kernel,
  kernels/gemm_ws.py, against the register-A kernel in the same run; --persistent: one program per
  SM over its tiles against one per tile)"""
import argparse
import json
import os

import torch

from fp4moe.bench.timing import measure_bf16_peak, time_cuda_graph
from fp4moe.formats import MXFP4, NVFP4
from fp4moe.ops.linear import fp4_linear_reference
from fp4moe.ops.mma_pack import pack_mma
from fp4moe.ops.wgmma import choose_wgmma_config, launch_linear_wgmma, WgmmaConfig
from fp4moe.quantize import quantize

CONFIGS = [WgmmaConfig(), WgmmaConfig(warps=8),
           WgmmaConfig(block_m=256, warps=8, repeats=1, stages=4), WgmmaConfig(block_m=256, warps=8, repeats=1, stages=3),
           WgmmaConfig(block_m=256, warps=4, repeats=1, stages=3), WgmmaConfig(block_m=256, warps=4, repeats=1, stages=4),
           WgmmaConfig(block_m=256, warps=8, repeats=1, stages=4, group_m=4),
           WgmmaConfig(block_m=256, warps=8, repeats=1, stages=4, group_m=16),
           WgmmaConfig(block_m=128, warps=8, repeats=1, stages=4)]

MID_CONFIGS = [WgmmaConfig(), WgmmaConfig(block_m=64), WgmmaConfig(block_m=64, warps=8, repeats=1),
               WgmmaConfig(block_m=128, warps=8, repeats=1), WgmmaConfig(block_m=256, warps=8, repeats=1),
               WgmmaConfig(block_m=256, warps=8, repeats=1, stages=3)]

#: the warp-specialized kernel against the register-A kernel's 256- and 128-row tiles
WS_CONFIGS = [WgmmaConfig(block_m=256, warps=8, repeats=1), WgmmaConfig(block_m=128, warps=8, repeats=1)] + [
    WgmmaConfig(block_m=bm, warps=8, repeats=1, stages=s, ws=True) for bm, s in [(256, 4), (256, 5), (128, 6), (64, 8)]]

#: one program per SM over its share of the tiles against a program per tile
PERSISTENT_CONFIGS = [WgmmaConfig(block_m=bm, warps=8, repeats=1, stages=s, persistent=p)
                      for bm, s in [(256, 4), (256, 3)] for p in (False, True)]

DEPTH_CONFIGS = [WgmmaConfig(block_m=256, warps=8, repeats=1, stages=s, group_m=g) for s in (3, 4, 5, 6) for g in (8, 16)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--ms", default="1024,4096,16384")
    modes = ap.add_mutually_exclusive_group()
    modes.add_argument("--mid", action="store_true", help="M = 96..2048 and the configurations that compete there")
    modes.add_argument("--depth", action="store_true",
                       help="M = 4096, 16384: ring depth and raster group of 256-row tiles")
    ap.add_argument("--shapes", default="12288x6144,6144x12288,4096x6144,6144x2048", help="NxK,... to time")
    modes.add_argument("--ws", action="store_true", help="the warp-specialized kernel's variants (WS_CONFIGS)")
    modes.add_argument("--persistent", action="store_true", help="persistent programs against one per tile")
    args = ap.parse_args()
    global CONFIGS
    if args.mid:
        CONFIGS = MID_CONFIGS
        args.ms = "96,128,192,256,384,512,768,1024,2048"
    if args.depth:
        CONFIGS = DEPTH_CONFIGS
        args.ms = "4096,16384"
    if args.persistent:
        CONFIGS = PERSISTENT_CONFIGS
    if args.ws:
        CONFIGS = WS_CONFIGS
        if args.ms == ap.get_default("ms"):
            args.ms = "256,1024,4096,16384"
    dev = "cuda"
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": [], "time": []}
    # correctness: every configuration, both formats, ragged M and N, bias
    for fmt in (NVFP4, MXFP4):
        for M, N, K in [(300, 272, 320), (1000, 6144, 2048), (77, 512, 2880)]:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            w = quantize(torch.randn(N, K, device=dev), fmt)
            b = torch.randn(N, device=dev, dtype=torch.bfloat16)
            p = pack_mma(w)
            ref = fp4_linear_reference(x, w, b).float()
            first = None
            for c in CONFIGS:
                y = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
                launch_linear_wgmma(x, p, b, y, c)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                ok = err < 2e-2 and bool(torch.isfinite(y).all())
                first = y if first is None else first
                same = bool(torch.equal(y, first))  # the same products in the same K order as the first
                res["checks"].append(dict(fmt=str(fmt), M=M, N=N, K=K, cfg=str(c), rel_err=err, ok=ok,
                                          equal_to_first=same))
                if not ok:
                    print("FAIL", fmt, M, N, K, c, err, flush=True)
    print("checks", len(res["checks"]), "failed", sum(not r["ok"] for r in res["checks"]),
          "differ from the first configuration", sum(not r["equal_to_first"] for r in res["checks"]), flush=True)
    peak = measure_bf16_peak()
    res["bf16_tflops"] = peak
    for N, K in [tuple(map(int, nk.split("x"))) for nk in args.shapes.split(",")]:
        w = quantize(torch.randn(N, K, device=dev), NVFP4)
        p = pack_mma(w)
        wb = w.dequantize(torch.bfloat16)
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            row = dict(N=N, K=K, M=M, heuristic=str(choose_wgmma_config(M, N, K)),
                       torch_us=time_cuda_graph(lambda: torch.matmul(x, wb.t()), iters_per_graph=10, reps=10).median_us)
            for c in CONFIGS:
                row[str(c)] = time_cuda_graph(lambda: launch_linear_wgmma(x, p, None, y, c), iters_per_graph=10,
                                              reps=10).median_us
            best = min((v, k) for k, v in row.items() if k.startswith("wgmma"))
            print(f"{N}x{K} M={M}: torch {row['torch_us']:.1f} best {best[1]} {best[0]:.1f} us "
                  f"({row['torch_us'] / best[0]:.2f}x, {2 * M * N * K / best[0] / 1e6:.0f} TFLOP/s) | "
                  + " ".join(f"{k}={v:.1f}" for k, v in row.items() if k.startswith("wgmma")), flush=True)
            res["time"].append(row)
    if args.out:
        stem = "sweep-wgmma-tiles" + ("-mid" if args.mid else "-depth" if args.depth else "-ws" if args.ws
                                      else "-persistent" if args.persistent else "")
        with open(os.path.join(args.out, f"{stem}-h200.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
