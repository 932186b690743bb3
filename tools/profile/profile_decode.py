"""Where the W4A16 decode time goes (GPU only): per-kernel CUDA time of the mma.sync decode path
(main kernel, split-K reduction) under CUDA-graph replay with rotating weights, against the total
per call; the floor a pure streaming read of the same bytes reaches in the same setting; and the
per-kernel cost of back-to-back launches in a graph, with and without programmatic dependent
launch (PDL).
Usage: PYTHONPATH=src python3 tools/profile/profile_decode.py [--out DIR]"""
import json
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fp4moe.bench.timing import kernel_times, l2_bytes, measure_copy_bandwidth, rotating, rotation_count, time_cuda_graph
from fp4moe.formats import NVFP4
from fp4moe.ops.mma_pack import pack_mma
from fp4moe.ops.mma_sync import choose_mma_config, launch_linear_mma
from fp4moe.quantize import quantize


@triton.jit
def _read_kernel(p, out, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(p + offs, mask=offs < n, other=0)
    tl.store(out + pid, tl.xor_sum(v, axis=0))


@triton.jit
def _tiny_kernel(out, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    tl.store(out + tl.program_id(0), 1)


def main() -> None:
    out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    dev = "cuda"
    res = {"copy_gbs": measure_copy_bandwidth(), "linear": [], "read": [], "launch": []}
    print("copy GB/s", res["copy_gbs"], flush=True)
    for pdl in (False, True):
        o = torch.zeros(1024, dtype=torch.int32, device=dev)
        for grid in (1, 132, 768):
            t = time_cuda_graph(lambda: _tiny_kernel[(grid,)](o, PDL=pdl, launch_pdl=pdl), iters_per_graph=50, reps=10)
            res["launch"].append(dict(pdl=pdl, grid=grid, us=t.median_us))
            print("tiny kernel", "pdl" if pdl else "", grid, f"{t.median_us:.2f} us", flush=True)
    for (N, K) in [(12288, 6144), (6144, 12288), (4096, 6144), (6144, 2048)]:
        nbytes = N * K // 2 + N * K // 16
        bound = nbytes / (res["copy_gbs"] * 1e3)
        nsets = rotation_count(nbytes, l2_bytes())
        bufs = [torch.randint(0, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=dev) for _ in range(nsets)]
        for block in (2048, 8192):
            for pdl in (False, True):
                o = torch.empty(triton.cdiv(nbytes // 4, block), dtype=torch.int32, device=dev)
                t = time_cuda_graph(rotating(lambda b: _read_kernel[(o.numel(),)](b, o, b.numel(), BLOCK=block, PDL=pdl,
                                                                                   launch_pdl=pdl), [(b,) for b in bufs]),
                                    iters_per_graph=20, reps=10)
                res["read"].append(dict(N=N, K=K, block=block, pdl=pdl, us=t.median_us, frac=bound / t.median_us))
                print(f"read {N}x{K} block {block} pdl {pdl}: {t.median_us:.2f} us = {bound / t.median_us:.0%}", flush=True)
        del bufs
        ws = [pack_mma(quantize(torch.randn(N, K, device=dev), NVFP4)) for _ in range(nsets)]
        for M in (1, 16):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            cfg = choose_mma_config(M, N, K)
            fn = rotating(lambda p: launch_linear_mma(x, p, None, y, cfg), [(p,) for p in ws])
            t = time_cuda_graph(fn, iters_per_graph=20, reps=10).median_us
            kt = kernel_times(fn)
            row = dict(N=N, K=K, M=M, cfg=str(cfg), us=t, frac=bound / t, kernels=kt)
            res["linear"].append(row)
            print(f"linear {N}x{K} M={M} {cfg}: {t:.2f} us ({bound / t:.0%}); kernels "
                  + ", ".join(f"{k[:30]} {v:.2f}" for k, v in kt.items()), flush=True)
        del ws
    if out_dir:
        with open(f"{out_dir}/profile-decode-h200.json", "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
