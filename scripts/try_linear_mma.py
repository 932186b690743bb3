"""GPU check and sweep of the MMA-layout W4A16 kernel (kernels/linear_mma.py) against the reference
and the Triton kernel: correctness on odd shapes, then timings on the GLM-5 shapes.
Usage: PYTHONPATH=src python3 scripts/try_linear_mma.py [--out DIR]"""
import json, sys
import torch
from fp4moe.formats import NVFP4, MXFP4
from fp4moe.quantize import quantize
from fp4moe.ops.linear import fp4_linear_reference, launch_linear, choose_config
from fp4moe.ops.mma_layout import pack_mma, launch_linear_mma, MMAConfig, choose_mma_config
from fp4moe.bench.timing import time_cuda_graph, measure_copy_bandwidth, rotating, rotation_count, l2_bytes

out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
dev = "cuda"
torch.manual_seed(0)
res = {"check": [], "time": []}
# correctness
for fmt in (NVFP4, MXFP4):
    for (M, N, K) in [(1, 64, 256), (3, 80, 320), (17, 4096, 6144), (16, 200, 1024), (64, 512, 2048), (5, 48, 64), (33, 96, 192)]:
        for cfg in [None, MMAConfig(block_m=8, kh=1), MMAConfig(rb=2, warps=2, kh=2, block_m=16, split_k=3)]:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            w = quantize(torch.randn(N, K, device=dev), fmt)
            b = torch.randn(N, device=dev, dtype=torch.bfloat16)
            p = pack_mma(w)
            c = cfg or choose_mma_config(M, N, K)
            y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            launch_linear_mma(x, p, b, y, c)
            ref = fp4_linear_reference(x, w, b)
            err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            ok = err < 2e-2 and torch.isfinite(y).all().item()
            res["check"].append(dict(fmt=str(fmt), M=M, N=N, K=K, cfg=str(c), rel_err=err, ok=bool(ok)))
            print("check", fmt, M, N, K, c, f"{err:.2e}", "OK" if ok else "FAIL", flush=True)
copy = measure_copy_bandwidth()
print("copy GB/s", copy)
res["copy_gbs"] = copy
shapes = [(12288, 6144), (6144, 12288), (4096, 6144), (6144, 2048)]
for (N, K) in shapes:
    w = quantize(torch.randn(N, K, device=dev), NVFP4)
    wbytes = w.data.numel() + w.scales.numel()
    bound_us = wbytes / (copy * 1e3)
    nsets = rotation_count(wbytes, l2_bytes())
    ws = [quantize(torch.randn(N, K, device=dev), NVFP4) for _ in range(nsets)]
    ps = [pack_mma(q) for q in ws]
    for M in (1, 16, 64):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        cfgs = [choose_mma_config(M, N, K)]
        base = cfgs[0]
        for rb, warps in [(1, 4), (1, 2), (1, 1), (2, 4), (1, 8)]:
            for split in (2, 4, 8):
                for kh in ((4, 2) if M <= 16 else (1, 2)):
                    c = MMAConfig(rb=rb, warps=warps, kh=kh, block_m=base.block_m, split_k=split)
                    if c not in cfgs: cfgs.append(c)
        best = None
        for c in cfgs:
            try:
                t = time_cuda_graph(rotating(lambda p: launch_linear_mma(x, p, None, y, c), [(p,) for p in ps]), iters_per_graph=20, reps=10).median_us
            except Exception as e:
                print("fail", c, repr(e)[:200]); continue
            res["time"].append(dict(kernel="mma", N=N, K=K, M=M, cfg=str(c), us=t, frac=bound_us / t))
            if best is None or t < best[1]: best = (c, t)
        oc = choose_config(M, N, K, path="w4a16", arch=None, sm_count=132)
        t_old = time_cuda_graph(rotating(lambda q: launch_linear(x, None, q, None, y, "w4a16", oc), [(q,) for q in ws]), iters_per_graph=20, reps=10).median_us
        t_def = [r["us"] for r in res["time"] if r["N"] == N and r["K"] == K and r["M"] == M and r["cfg"] == str(base)][0]
        print(f"N={N} K={K} M={M}: bound {bound_us:.1f}us old {t_old:.1f} ({bound_us/t_old:.0%}) mma default {base} {t_def:.1f} ({bound_us/t_def:.0%}) best {best[0]} {best[1]:.1f} ({bound_us/best[1]:.0%})", flush=True)
        res["time"].append(dict(kernel="triton", N=N, K=K, M=M, cfg=str(oc), us=t_old, frac=bound_us / t_old))
if out_dir:
    json.dump(res, open(f"{out_dir}/try_linear_mma.json", "w"), indent=1)
