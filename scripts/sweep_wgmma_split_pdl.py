"""The split-K wgmma linear (M = 17..64 on SM90) with and without programmatic dependent launch
(``ops.mma_layout.SPLIT_PDL``; ``FP4MOE_PDL=0`` turns it off per call), interleaved in one process:
GLM-5 shapes, the runtime's configurations, weights rotating past the L2 as in ``fp4moe bench linear``.
GPU only. Usage: PYTHONPATH=src python3 scripts/sweep_wgmma_split_pdl.py [--ms 17,32,64] [--repeat 2] [--out F.json]"""
import argparse
import json
import os

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="17,32,64")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()

    from fp4moe.arch import get_arch
    from fp4moe.bench.timing import l2_bytes, measure_copy_bandwidth, rotating, rotation_count, time_cuda_graph
    from fp4moe.formats import NVFP4
    from fp4moe.ops.linear import packed_config
    from fp4moe.ops.mma_layout import launch_linear_wgmma, pack_mma
    from fp4moe.quantize import quantize

    user_pdl = os.environ.get("FP4MOE_PDL")
    arch = get_arch(torch.cuda.get_device_capability())
    copy = measure_copy_bandwidth()
    res = {"copy_gbs": copy, "time": []}
    for N, K in [(12288, 6144), (6144, 12288), (4096, 6144), (6144, 2048)]:
        w0 = quantize(torch.randn(N, K, device="cuda"), NVFP4)
        wbytes = w0.data.numel() + w0.scales.numel()
        ps = [pack_mma(quantize(torch.randn(N, K, device="cuda"), NVFP4))
              for _ in range(rotation_count(wbytes, l2_bytes()))]
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            c = packed_config("w4a16", arch, M, N, K, fmt="nvfp4", l2_bytes=l2_bytes())
            fn = rotating(lambda p, c=c: launch_linear_wgmma(x, p, None, y, c), [(p,) for p in ps])
            for p in ps:  # every pack launched once: its first launch waits before any load
                launch_linear_wgmma(x, p, None, y, c)
            for rep in range(args.repeat):
                for pdl in (False, True):
                    os.environ["FP4MOE_PDL"] = "1" if pdl else "0"
                    t = time_cuda_graph(fn, iters_per_graph=20, reps=10).median_us
                    frac = wbytes / (copy * 1e3) / t
                    res["time"].append(dict(N=N, K=K, M=M, cfg=str(c), pdl=pdl, rep=rep, us=t, frac=frac))
                    print(f"{N}x{K} M={M} {c} pdl={pdl}: {t:.2f} us ({frac:.1%})", flush=True)
        del ps, w0
    if user_pdl is None:
        os.environ.pop("FP4MOE_PDL", None)
    else:
        os.environ["FP4MOE_PDL"] = user_pdl
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
