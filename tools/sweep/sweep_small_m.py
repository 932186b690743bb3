"""Small batches on the wgmma kernel (SM90): 16- and 32-row activation tiles and split-K
(``WgmmaConfig.block_m`` 16/32, ``split_k``). Checks first (MoE layers with 16/32-row tiles against
the reference), then the four
GLM-5 linear shapes at M = 16, 32, 64 against the runtime's current choice (rotating weights, so
nothing is served from L2), then the GLM-5 MoE layer (experts: dispatch..combine) at 128, 256 and
512 tokens (4, 8, 16 rows per expert) with the runtime's choice against wgmma tiles of 16 and 32
rows, then the prefill defaults (linear and MoE at 4096 rows) as a guard. GPU only.
Usage: PYTHONPATH=src python3 tools/sweep/sweep_small_m.py [--out DIR] [--part check,linear,moe]"""
import argparse
import json
import os

import torch

from fp4moe.bench.timing import l2_bytes, measure_copy_bandwidth, rotating, rotation_count, time_cuda_graph
from fp4moe.formats import NVFP4
from fp4moe.ops import moe as moe_ops
from fp4moe.ops.linear import device_arch, fp4_linear, mma_packed
from fp4moe.ops.wgmma import launch_linear_wgmma, WgmmaConfig
from fp4moe.quantize import quantize, quantize_stacked

_RUNTIME = moe_ops.packed_layout_config


def linear_cfgs(M: int) -> list[WgmmaConfig]:
    bm = min(max(16, 1 << (M - 1).bit_length()), 256)
    return [WgmmaConfig(block_m=bm, warps=w, repeats=r, stages=s, split_k=sp)
            for (w, r) in ((4, 1), (8, 1), (4, 2), (8, 2)) for s in (4, 6) for sp in (1, 2, 3, 4, 6, 8)]


def check(res: dict) -> None:
    """MoE layers with the wgmma tiles forced (the runtime would not pick them at these sizes). The
    linear configurations are checked by the GPU tests (``test_gpu_wgmma_linear_matches_reference``
    runs split-K and 16/32-row tiles through ``layer_checks.check_packed_linear``)."""
    for T, E, k, H, I, fmt in [(100, 16, 4, 512, 256, "nvfp4"), (64, 8, 2, 256, 128, "mxfp4"),
                               (300, 64, 8, 1024, 512, "nvfp4")]:
        p = moe_ops.random_moe_problem(T, E, k, H, I, fmt, device="cuda", seed=T, dropped=(0, k - 1))
        ref = moe_ops.fp4_moe_reference(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights).float()
        for c in (WgmmaConfig(block_m=16, stages=6, warps=4), WgmmaConfig(block_m=32, stages=4, warps=4)):
            moe_ops.packed_layout_config = lambda *a, c=c: c
            y = moe_ops.fp4_moe_experts(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights)
            moe_ops.packed_layout_config = _RUNTIME
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            ok = err < 2e-2 and bool(torch.isfinite(y).all())
            res["check"].append(dict(moe=True, T=T, E=E, k=k, H=H, I=I, fmt=fmt, cfg=str(c), rel_err=err, ok=ok))
            print("check moe", T, E, k, H, I, fmt, c, f"{err:.2e}", "OK" if ok else "FAIL", flush=True)


def sweep_linear(res: dict) -> None:
    copy = res["copy_gbs"]
    for (N, K) in [(12288, 6144), (6144, 12288), (4096, 6144), (6144, 2048)]:
        w0 = quantize(torch.randn(N, K, device="cuda"), NVFP4)
        bound = (w0.data.numel() + w0.scales.numel()) / (copy * 1e3)
        ws = [quantize(torch.randn(N, K, device="cuda"), NVFP4)
              for _ in range(rotation_count(w0.data.numel() + w0.scales.numel(), l2_bytes()))]
        ps = [mma_packed(w) for w in ws]  # the packs fp4_linear finds
        for M in (16, 32, 64):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            runs = [("runtime", rotating(lambda w: fp4_linear(x, w, None), [(w,) for w in ws]))]
            runs += [(str(c), rotating(lambda p, c=c: launch_linear_wgmma(x, p, None, y, c), [(p,) for p in ps]))
                     for c in linear_cfgs(M)]
            for name, fn in runs:
                try:
                    t = time_cuda_graph(fn, iters_per_graph=20, reps=10).median_us
                except Exception as e:  # noqa: BLE001 - a sweep records what fails and goes on
                    print("fail", name, repr(e)[:300], flush=True)
                    continue
                res["linear"].append(dict(N=N, K=K, M=M, cfg=name, us=t, frac=bound / t))
                print(f"{N}x{K} M={M} {name}: {t:.2f} us {bound / t:.0%}", flush=True)
        del ws, ps


def sweep_moe(res: dict) -> None:
    from fp4moe.models import get_model
    from fp4moe.ops.routing import make_router

    E, H, I = 256, 6144, 2048
    w13 = quantize_stacked(torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16), "nvfp4")
    w2 = quantize(torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16), "nvfp4")
    moe_ops.mma_packed_experts(w13)
    moe_ops.mma_packed_experts(w2)
    route = make_router(get_model("glm-5"))
    per_expert = 3 * I * H * (0.5 + 1 / 16)  # FP4 bytes + E4M3 scales
    for T in (128, 256, 512):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        ids, wts, _ = route(torch.randn(T, E, device="cuda"))
        bound = int(ids.unique().numel()) * per_expert / (res["copy_gbs"] * 1e3)
        cfgs = [None] + [WgmmaConfig(block_m=bm, stages=s, warps=w) for bm in (16, 32) for s in (4, 6) for w in (4, 8)]
        for c in cfgs:
            moe_ops.packed_layout_config = _RUNTIME if c is None else (lambda *a, c=c: c)
            try:
                t = time_cuda_graph(lambda: moe_ops.fp4_moe_experts(x, w13, w2, ids, wts), iters_per_graph=3,
                                    reps=7).median_us
            except Exception as e:  # noqa: BLE001
                print("fail", c, repr(e)[:300], flush=True)
                continue
            finally:
                moe_ops.packed_layout_config = _RUNTIME
            name = "runtime" if c is None else str(c)
            res["moe"].append(dict(T=T, cfg=name, us=t, frac=bound / t))
            print(f"moe T={T} {name}: {t:.1f} us {bound / t:.0%}", flush=True)


def prefill(res: dict) -> None:
    """The prefill defaults (plain linear at M = 4096, GLM-5 experts at 4096 tokens): a kernel
    change aimed at small M must not cost these."""
    from fp4moe.models import get_model
    from fp4moe.ops.wgmma import choose_wgmma_config
    from fp4moe.ops.routing import make_router

    for (N, K) in [(12288, 6144), (6144, 2048)]:
        w = quantize(torch.randn(N, K, device="cuda"), NVFP4)
        p = mma_packed(w)
        x = torch.randn(4096, K, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(4096, N, device="cuda", dtype=torch.bfloat16)
        c = choose_wgmma_config(4096, N, K)
        t = time_cuda_graph(lambda: launch_linear_wgmma(x, p, None, y, c), iters_per_graph=5, reps=10).median_us
        res["prefill"].append(dict(N=N, K=K, M=4096, cfg=str(c), us=t))
        print(f"prefill {N}x{K} M=4096 {c}: {t:.1f} us", flush=True)
    E, H, I = 256, 6144, 2048
    w13 = quantize_stacked(torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16), "nvfp4")
    w2 = quantize(torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16), "nvfp4")
    route = make_router(get_model("glm-5"))
    x = torch.randn(4096, H, device="cuda", dtype=torch.bfloat16)
    ids, wts, _ = route(torch.randn(4096, E, device="cuda"))
    t = time_cuda_graph(lambda: moe_ops.fp4_moe_experts(x, w13, w2, ids, wts), iters_per_graph=3, reps=7).median_us
    res["prefill"].append(dict(moe="glm-5", T=4096, us=t))
    print(f"prefill moe T=4096: {t:.1f} us", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--part", default="check,linear,moe,prefill")
    args = ap.parse_args()
    parts = args.part.split(",")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "arch": device_arch(torch.device("cuda")).name, "copy_gbs": measure_copy_bandwidth(), "check": [],
           "linear": [], "moe": [], "prefill": []}
    if "check" in parts:
        check(res)
    if "linear" in parts:
        sweep_linear(res)
    if "moe" in parts:
        sweep_moe(res)
    if "prefill" in parts:
        prefill(res)
    if args.out:
        with open(os.path.join(args.out, "sweep-small-m-h200.json"), "w") as f:
            json.dump(res, f, indent=1)
    print("checks failed:", sum(not r["ok"] for r in res["check"]))


if __name__ == "__main__":
    main()
