"""Measurement: the bf16 mma.sync (m16n8k16, fp32 accumulate) issue rate of the GPU in hand, the
instruction the decode kernels (``kernels/linear_mma.py``) run, against torch's bf16 matmul in the
same process. Each warp keeps A [16 RB, 64] and B [64, N] in registers and runs RB * N / 8
independent accumulator chains; every program repeats ``--iters`` times. Prints TFLOP/s per
(programs per SM, N). GPU only.
Usage: PYTHONPATH=src python3 tools/probe/mma_sync_peak.py [--iters 4096] [--out DIR]"""
import argparse
import json
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2


@gluon.jit
def _mma_loop(a_ptr, b_ptr, out_ptr, iters, RB: gl.constexpr, N: gl.constexpr, WARPS: gl.constexpr):
    M: gl.constexpr = 16 * RB * WARPS
    K: gl.constexpr = 64
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    am = gl.arange(0, M, layout=gl.SliceLayout(1, a_l))
    ak = gl.arange(0, K, layout=gl.SliceLayout(0, a_l))
    a = gl.load(a_ptr + gl.expand_dims(am, 1) * K + gl.expand_dims(ak, 0))
    bk = gl.arange(0, K, layout=gl.SliceLayout(1, b_l))
    bn = gl.arange(0, N, layout=gl.SliceLayout(0, b_l))
    b = gl.load(b_ptr + gl.expand_dims(bk, 1) * N + gl.expand_dims(bn, 0))
    acc = gl.zeros([M, N], gl.float32, layout=mma)
    for _ in range(iters):
        acc = mma_v2(a, b, acc)
    om = gl.arange(0, M, layout=gl.SliceLayout(1, mma))
    on = gl.arange(0, N, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + gl.program_id(0) * M * N + gl.expand_dims(om, 1) * N + gl.expand_dims(on, 0), acc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=4096)
    ap.add_argument("--out")
    args = ap.parse_args()
    from fp4moe.bench.timing import time_cuda_graphs

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    WARPS = 4
    rows, fns, flops = [], {}, {}
    for rb in (2, 4):
        for n in (8, 16):
            for per_sm in (2, 4, 8):
                M = 16 * rb * WARPS
                a = torch.randn(M, 64, device="cuda").to(torch.bfloat16) * 0.01
                b = torch.randn(64, n, device="cuda").to(torch.bfloat16) * 0.01
                grid = per_sm * sms
                out = torch.empty(grid, M, n, device="cuda")
                name = f"rb{rb} n{n} {per_sm}/SM"
                fns[name] = (lambda a=a, b=b, out=out, grid=grid, rb=rb, n=n:
                             _mma_loop[(grid,)](a, b, out, args.iters, RB=rb, N=n, WARPS=WARPS, num_warps=WARPS))
                flops[name] = 2.0 * grid * M * n * 64 * args.iters
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    fns["torch matmul 8192^3"] = lambda: x @ x
    flops["torch matmul 8192^3"] = 2.0 * 8192 ** 3
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    res = time_cuda_graphs(fns, iters_per_graph=3, reps=10)
    for name, r in res.items():
        tf = flops[name] / r.median_us / 1e6
        rows.append(dict(case=name, us=r.median_us, tflops=tf))
        print(f"{name:24s} {r.median_us:10.1f} us {tf:8.1f} TFLOP/s", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(f"{args.out}/mma-sync-peak-h200.json", "w") as f:
            json.dump(dict(about=__doc__.splitlines()[0], sms=sms, iters=args.iters, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
