"""Where the emulated W4A4 linear's time goes on a GPU without FP4 MMA (GPU only): per call, W4A4
against W4A16 on the same weights (CUDA graphs, weights rotating past the L2 as in ``fp4moe bench
linear``), with a per-call (dynamic) and a static activation global scale, and the per-kernel CUDA
time of the W4A4 chain (absmax, quantize, dequantize, GEMM; without PDL, so that no kernel's time
includes its wait for the one before).
Usage: PYTHONPATH=src python3 tools/profile/profile_w4a4.py [--ms 1,16,4096] [--shapes 12288x6144,6144x2048]"""
import argparse
import os

import torch

from fp4moe.bench.timing import kernel_times, l2_bytes, rotating, rotation_count, time_cuda_graph
from fp4moe.ops.linear import fp4_linear
from fp4moe.quantize import quantize


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,16,4096")
    ap.add_argument("--shapes", default="12288x6144,6144x2048")
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        w0 = quantize(torch.randn(N, K, device="cuda"), "nvfp4")
        ws = [quantize(torch.randn(N, K, device="cuda"), "nvfp4")
              for _ in range(rotation_count(w0.data.numel() + w0.scales.numel(), l2_bytes()))]
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            gs = torch.tensor([0.01], device="cuda")
            row = []
            for label, kw in (("w4a16", {}), ("w4a4 dynamic", {"mode": "w4a4"}),
                              ("w4a4 static", {"mode": "w4a4", "input_global_scale": gs})):
                for w in ws:  # every weight once before capture (packs, a pack's first launch)
                    fp4_linear(x, w, **kw)
                fn = rotating(lambda w, kw=kw: fp4_linear(x, w, **kw), [(w,) for w in ws])
                row.append(f"{label} {time_cuda_graph(fn, iters_per_graph=20, reps=10).median_us:.2f}")
            print(f"{shape} M={M}: " + ", ".join(row) + " us", flush=True)
            os.environ["FP4MOE_PDL"] = "0"
            for name, us in kernel_times(lambda: fp4_linear(x, ws[0], mode="w4a4"), calls=10).items():
                print(f"    {us:8.2f} us  {name}", flush=True)
            del os.environ["FP4MOE_PDL"]


if __name__ == "__main__":
    main()
