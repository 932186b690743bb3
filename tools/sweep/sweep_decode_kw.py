"""GPU check and sweep of the in-program K split of the W4A16 decode kernel
(``MMAConfig.kw`` > 1, ``fp4_linear_mma_kw_kernel``): correctness against the reference on odd
shapes (both formats, bias, padded K), run-to-run determinism, then timings on the GLM-5 shapes
against the current default (grid split K + reduction kernel), with and without PDL.
Usage: PYTHONPATH=src python3 tools/sweep/sweep_decode_kw.py [--out DIR] [--quick]"""
import json
import sys

import torch

from fp4moe.bench.timing import l2_bytes, measure_copy_bandwidth, rotating, rotation_count, time_cuda_graph
from fp4moe.formats import MXFP4, NVFP4
from fp4moe.ops.linear import fp4_linear_reference
from fp4moe.ops.mma_pack import pack_mma
from fp4moe.ops.mma_sync import choose_mma_config, launch_linear_mma, MMAConfig
from fp4moe.quantize import quantize


def check(res: dict) -> None:
    dev = "cuda"
    torch.manual_seed(0)
    cases = [(1, 64, 256), (3, 80, 320), (17, 4096, 6144), (16, 200, 1024), (5, 48, 64), (8, 1000, 2048), (2, 16, 96)]
    cfgs = [MMAConfig(rb=1, warps=1, kw=4, kh=4, block_m=8), MMAConfig(rb=1, warps=2, kw=8, kh=2, block_m=8, pdl=1),
            MMAConfig(rb=2, warps=1, kw=4, kh=4, block_m=16, pdl=2), MMAConfig(rb=1, warps=2, kw=2, kh=4, block_m=16, pdl=2),
            MMAConfig(rb=4, warps=1, kw=4, kh=1, block_m=16)]
    for fmt in (NVFP4, MXFP4):
        for (M, N, K) in cases:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            w = quantize(torch.randn(N, K, device=dev), fmt)
            b = torch.randn(N, device=dev, dtype=torch.bfloat16)
            p = pack_mma(w)
            ref = fp4_linear_reference(x, w, b).float()
            for c in cfgs:
                y = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
                launch_linear_mma(x, p, b, y, c)
                y2 = torch.empty_like(y)
                launch_linear_mma(x, p, b, y2, c)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                same = bool(torch.equal(y, y2))
                ok = err < 2e-2 and bool(torch.isfinite(y).all()) and same
                res["check"].append(dict(fmt=str(fmt), M=M, N=N, K=K, cfg=str(c), rel_err=err, deterministic=same,
                                         ok=ok))
                print("check", fmt, M, N, K, c, f"{err:.2e}", "same" if same else "DIFFERS", "OK" if ok else "FAIL",
                      flush=True)


def sweep(res: dict, quick: bool) -> None:
    dev = "cuda"
    copy = res["copy_gbs"]
    for (N, K) in [(12288, 6144), (6144, 12288), (4096, 6144), (6144, 2048)]:
        w0 = quantize(torch.randn(N, K, device=dev), NVFP4)
        wbytes = w0.data.numel() + w0.scales.numel()
        bound = wbytes / (copy * 1e3)
        ps = [pack_mma(quantize(torch.randn(N, K, device=dev), NVFP4)) for _ in range(rotation_count(wbytes, l2_bytes()))]
        for M in ((1, 16) if quick else (1, 4, 8, 16)):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            bm = 8 if M <= 8 else 16
            cfgs = [choose_mma_config(M, N, K)]
            if M <= 8:
                shapes = [(1, 1, kw, kh) for kw in (4, 8) for kh in (2, 4)] + [(1, 2, 4, 4), (1, 2, 8, 4)]
            else:
                shapes = [(rb, warps, kw, kh) for rb in (1, 2) for warps in (1, 2) for kw in (4, 8) for kh in (2, 4)]
                shapes += [(4, 1, 4, 1), (4, 1, 8, 1), (4, 1, 4, 2), (4, 2, 4, 1)]
            for (rb, warps, kw, kh) in shapes:
                for pdl in (0, 1, 2):
                    cfgs.append(MMAConfig(rb=rb, warps=warps, kw=kw, kh=kh, block_m=bm, pdl=pdl))
            for c in cfgs:
                try:
                    t = time_cuda_graph(rotating(lambda p: launch_linear_mma(x, p, None, y, c), [(p,) for p in ps]),
                                        iters_per_graph=20, reps=10).median_us
                except Exception as e:  # noqa: BLE001 - a sweep records what fails and goes on
                    print("fail", c, repr(e)[:300], flush=True)
                    continue
                res["time"].append(dict(N=N, K=K, M=M, cfg=str(c), us=t, frac=bound / t))
                print(f"{N}x{K} M={M} {c}: {t:.2f} us {bound / t:.0%}", flush=True)
        del ps


def main() -> None:
    out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    res = {"check": [], "time": [], "copy_gbs": measure_copy_bandwidth()}
    check(res)
    sweep(res, "--quick" in sys.argv)
    if out_dir:
        with open(f"{out_dir}/sweep-decode-kw-h200.json", "w") as f:
            json.dump(res, f, indent=1)
    print("checks failed:", sum(not r["ok"] for r in res["check"]))


if __name__ == "__main__":
    main()
