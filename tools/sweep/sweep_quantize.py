"""GPU check and sweep of the NVFP4 activation quantizer (development tool; the heuristic is set from its output).

Usage on a GPU machine: PYTHONPATH=src python tools/sweep/sweep_quantize.py [--out DIR] [--baseline FILE]
1. Bit-exactness of ``ops.quantize.quantize_activations`` against ``fp4moe.quantize`` on the GPU
   (bf16 / fp16 / fp32, given and dynamic global scales, masked tails, subnormal and saturated
   blocks, E2M1 ties and rounding boundaries), and of the kernel's reciprocal against 1 / d.
2. Times, with CUDA graphs (``bench.timing``), bf16 [16384, 6144] with a given and with the dynamic
   global scale for a sweep of QuantizeConfig tiles, and the original kernel (``--baseline``, a copy
   of the previous ``kernels/quantize.py``) when given; fractions are of the copy bandwidth measured
   in the same run, with the bytes ``bench.linear.run_quantize_bench`` counts.
``--structure`` instead times the heuristic's tiles under register caps (``maxnreg``) and a
pure-traffic floor (the same loads and stores, an XOR for the arithmetic), after the checks and an
exhaustive check of the short-significand division (``kernels.quantize_arith.div_by_reciprocal``).
Prints a table; writes JSON to --out (default $OUT).
"""

import argparse
import importlib.util
import json
import os
import time

import torch
import triton
import triton.language as tl

import fp4moe
from fp4moe.bench.timing import measure_copy_bandwidth, time_cuda_graph, warm_up_gpu
from fp4moe.kernels import quantize as qk
from fp4moe.kernels.quantize_arith import div_by_reciprocal, reciprocal_rn_asm
from fp4moe.ops.linear import device_arch
from fp4moe.ops.quantize import QuantizeConfig, quantize_activations
from fp4moe.quantize import nvfp4_global_scale
from fp4moe.tuning import tuning


def same(a, b):
    return (torch.equal(a.data, b.data) and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
            and torch.equal(a.global_scale.view(torch.int32), b.global_scale.view(torch.int32)))


def inputs(gen):
    """(name, x, global_scale) cases on the GPU."""
    dev = "cuda"
    out = []
    x = torch.randn(4096, 6144, device=dev, generator=gen) * 3
    x[:, 100:116] = 0
    x[7] *= 1e-4
    x[9, 32:48] = -0.0
    xb = x.to(torch.bfloat16)
    out += [("bf16 4096x6144 dynamic", xb, None), ("bf16 4096x6144 given", xb, 0.0123),
            ("bf16 4096x6144 given=amax", xb, "amax")]
    heavy = (torch.randn(1024, 2048, device=dev, generator=gen)
             / torch.rand(1024, 2048, device=dev, generator=gen).clamp_min(1e-4) ** 1.5)
    out += [("bf16 heavy-tailed dynamic", heavy.to(torch.bfloat16), None),
            ("bf16 saturated g=1e-5", heavy.to(torch.bfloat16), 1e-5)]
    tiny = torch.randn(512, 1024, device=dev, generator=gen) * torch.logspace(-40, 2, 1024, device=dev)
    out += [("bf16 subnormal/tiny blocks dynamic", tiny.to(torch.bfloat16), None),
            ("bf16 subnormal/tiny blocks g=1e-3", tiny.to(torch.bfloat16), 1e-3)]
    # E2M1 ties and grid values exactly: blocks of amax 6 * 2**j
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.0, 6.0], device=dev)
    block = torch.cat([torch.tensor([6.0], device=dev), t])
    sign = torch.randint(0, 2, (256, 128, 16), device=dev, generator=gen) * 2.0 - 1.0
    scale = torch.exp2(torch.randint(-8, 9, (256, 128, 1), device=dev, generator=gen).float())
    out.append(("bf16 ties g=1", (block * sign * scale).reshape(256, 2048).to(torch.bfloat16), 1.0))
    # every bf16 bit pattern (finite), in blocks with a few scales
    allb = torch.arange(0, 1 << 16, dtype=torch.int32, device=dev).to(torch.int16).view(torch.bfloat16)
    allb = allb[torch.isfinite(allb.float())]
    allb = allb[: allb.numel() // 2048 * 2048].reshape(-1, 2048)
    for g in (1.0, 3.7e-3, 2.0 ** -80, 123.0):
        out.append((f"bf16 all patterns g={g:g}", allb, g))
    out.append(("bf16 all patterns dynamic", allb, None))
    # masked tails: M and K not multiples of the tile, K % 32 == 16
    for m, k in ((17, 272), (333, 48), (1, 16), (129, 6160), (64, 96)):
        xm = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        out += [(f"bf16 {m}x{k} dynamic", xm, None), (f"bf16 {m}x{k} given", xm, 0.02)]
    wide = torch.randn(9, 400, device=dev, generator=gen).to(torch.bfloat16)
    out += [("bf16 strided rows", wide[:, 32:304], None), ("bf16 misaligned rows", wide[:, 3:99], 0.5)]
    for dt in (torch.float16, torch.float32):
        xd = (torch.randn(1024, 1024, device=dev, generator=gen) * 2).to(dt)
        out += [(f"{dt} dynamic", xd, None), (f"{dt} given", xd, 0.01), (f"{dt} 17x272", xd[:17, :272], None)]
    out.append(("fp32 huge g=1e36", torch.randn(64, 1024, device=dev, generator=gen) * 1e30, 1e36))
    return out


@triton.jit
def _floor_kernel(x_ptr, data_ptr, scales_ptr, K, BLOCK_K: tl.constexpr):
    """The quantizer's traffic with almost no arithmetic (one row of BLOCK_K per program, as the
    heuristic's tiles): the same four 16-byte loads per thread and chunk, one 16-byte and one
    2-byte store."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1)
    r0, r1, r2, r3 = qk._load_tile(x_ptr + row * K + col * BLOCK_K, 1, BLOCK_K // 16, K, 1, BLOCK_K, False)
    words = r0 ^ r1 ^ r2 ^ r3  # [1, NC, 4]
    a, b = tl.split(tl.reshape(words, (1, BLOCK_K // 32, 2, 2)))
    chunks = tl.arange(0, BLOCK_K // 32)
    tl.store(data_ptr + row * (K // 8) + col * (BLOCK_K // 8) + chunks[None, :, None] * 4
             + tl.arange(0, 4)[None, None, :], words)
    tl.store(scales_ptr + row * (K // 16) + col * (BLOCK_K // 16) + chunks[None, :, None] * 2
             + tl.arange(0, 2)[None, None, :], (a ^ b).to(tl.uint8))


def structure_sweep(results, record, x, gs, want):
    """The heuristic's tiles with register caps (``maxnreg``), and the traffic floor."""
    M, K = x.shape
    data = torch.empty(M, K // 8, dtype=torch.int32, device="cuda")
    scales = torch.empty(M, K // 16, dtype=torch.uint8, device="cuda")
    gst = torch.as_tensor(gs, dtype=torch.float32, device="cuda").reshape(())
    sm86 = device_arch(x.device).has_xorsign_abs_max
    for bk, nw in ((2048, 2), (1024, 1)):
        for reg in (None, 64, 56, 48):
            def launch(bk=bk, nw=nw, reg=reg):
                qk.nvfp4_quantize_kernel[(M, K // bk)](x, data, scales, gst, gst, M, K, K, BLOCK_M=1, BLOCK_K=bk,
                                                       DYNAMIC=False, EMULATE_FMA=False, SM86=sm86,
                                                       num_warps=nw, maxnreg=reg)
            launch()
            ok = torch.equal(data.view(torch.uint8), want.data) and torch.equal(scales, want.scales.view(torch.uint8))
            results["checks"].append({"case": "timing input", "config": f"1x{bk} w{nw} maxnreg {reg}", "ok": ok})
            record(f"1x{bk} w{nw} maxnreg={reg}{'' if ok else ' MISMATCH'}", launch, kind="maxnreg", block_k=bk,
                   num_warps=nw, maxnreg=reg)
    for bk, nw in ((2048, 2), (1024, 1)):
        record(f"traffic floor 1x{bk} w{nw}", lambda: _floor_kernel[(M, K // bk)](x, data, scales, K, BLOCK_K=bk,
                                                                                 num_warps=nw), kind="floor")
    record(f"heuristic {QuantizeConfig.from_heuristic(M, K)} given", lambda: quantize_activations(x, gs), kind="new")
    record(f"heuristic {QuantizeConfig.from_heuristic(M, K)} dynamic", lambda: quantize_activations(x, None),
           kind="new", scale="dynamic")


@triton.jit
def _exhaustive_div_kernel(bad_ptr, SIG_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Mismatches of ``div_by_reciprocal`` against div.rn for a = 1 + i / 2**SIG_BITS (program
    axis 1) and every fp32 d in [1, 2) (axis 0 covers the 2**23 significands)."""
    a = 1.0 + tl.program_id(1).to(tl.float32) / (1 << SIG_BITS)
    bits = 0x3F800000 + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = bits.to(tl.float32, bitcast=True)
    q = div_by_reciprocal(tl.zeros_like(d) + a, d, reciprocal_rn_asm(d), False)
    want = tl.math.div_rn(tl.zeros_like(d) + a, d)
    tl.atomic_add(bad_ptr, tl.sum((q != want).to(tl.int32), axis=0))


def check_short_division():
    """Exhaustive: bf16 (7 fraction bits) and fp16 (10) significands x all fp32 divisor significands."""
    out = {}
    for name, bits in (("bf16", 7), ("fp16", 10)):
        bad = torch.zeros((), dtype=torch.int32, device="cuda")
        _exhaustive_div_kernel[((1 << 23) // 1024, 1 << bits)](bad, SIG_BITS=bits, BLOCK=1024)
        out[name] = int(bad)
        print(f"div_by_reciprocal vs div.rn, every {name} significand x every divisor significand: {out[name]} mismatches")
    return out


@triton.jit
def _rcp_kernel(d_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(out_ptr + offs, reciprocal_rn_asm(tl.load(d_ptr + offs, mask=mask, other=1.0)), mask=mask)


def check_reciprocal(gen):
    n = 1 << 24
    sig = torch.cat([1 + torch.rand(n // 2, device="cuda", generator=gen) ** 8,
                     2 - torch.rand(n // 2, device="cuda", generator=gen) ** 8])
    d = torch.ldexp(sig, torch.randint(-101, 111, (n,), device="cuda", generator=gen)).float()
    d = torch.cat([d, torch.arange(1 << 23, device="cuda", dtype=torch.int32).add_(0x3F800000).view(torch.float32)])
    out = torch.empty_like(d)
    _rcp_kernel[(triton.cdiv(d.numel(), 1024),)](d, out, d.numel(), BLOCK=1024)
    want = torch.ones_like(d) / d
    return int((out.view(torch.int32) != want.view(torch.int32)).sum())


def baseline_fn(path):
    """A launcher of the previous kernel (given global scale, its heuristic tile 16 x 512, 8 warps)."""
    spec = importlib.util.spec_from_file_location("quantize_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def run(x, gs, bm=16, bk=512, nw=8):
        M, K = x.shape
        data = torch.empty((M, K // 2), dtype=torch.uint8, device=x.device)
        scales = torch.empty((M, K // 16), dtype=torch.uint8, device=x.device)
        mod.nvfp4_quantize_kernel[(triton.cdiv(M, bm), triton.cdiv(K, bk))](
            x, data.view(torch.int32), scales, gs, gs, M, K, x.stride(0), BLOCK_M=bm, BLOCK_K=bk,
            DYNAMIC=False, EMULATE_FMA=False, num_warps=nw)
        return data, scales
    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--baseline", default=None)
    p.add_argument("--M", type=int, default=16384)
    p.add_argument("--K", type=int, default=6144)
    p.add_argument("--wide", action="store_true", help="only the widest row tiles (skips the bit-exactness cases)")
    p.add_argument("--structure", action="store_true", help="register caps and the traffic floor (after the checks)")
    args = p.parse_args()
    t0 = time.time()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "checks": [], "rows": []}
    gen = torch.Generator(device="cuda").manual_seed(0)

    # 1. bit-exactness
    bad = check_reciprocal(gen)
    results["reciprocal_mismatches"] = bad
    results["short_division_mismatches"] = check_short_division()
    print(f"reciprocal_rn_asm vs 1/d: {bad} mismatches of {(1 << 24) + (1 << 23)}")
    n_ok = 0
    cfgs = [None, QuantizeConfig(1, 32, 1), QuantizeConfig(32, 512, 8)]
    for name, x, gs in ([] if args.wide else inputs(gen)):
        if gs == "amax":
            gs = nvfp4_global_scale(x.float().abs().amax())
        want = fp4moe.quantize(x, "nvfp4", gs)
        for cfg in cfgs if x.numel() <= 4096 * 6144 else cfgs[:1]:
            ok = same(quantize_activations(x, gs, config=cfg), want)
            n_ok += ok
            results["checks"].append({"case": name, "config": str(cfg), "ok": bool(ok)})
            if not ok:
                print(f"MISMATCH: {name} config={cfg}")
    n = len(results["checks"])
    print(f"bit-exact: {n_ok}/{n} (case, config) pairs, {time.time() - t0:.1f} s")

    # 2. timing
    warm_up_gpu(1.0)
    bw = measure_copy_bandwidth()
    results["copy_gbs"] = bw
    M, K = args.M, args.K
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    gs = nvfp4_global_scale(x.abs().amax())
    nbytes = 2 * M * K + M * K // 2 + M * K // 16
    bound_us = nbytes / (bw * 1e3)
    print(f"copy bandwidth {bw:.0f} GB/s; [{M}, {K}] bf16: {nbytes / 1e6:.1f} MB -> {bound_us:.1f} us at copy bandwidth")

    def record(label, fn, **extra):
        t = time_cuda_graph(fn, iters_per_graph=20, reps=15)
        row = {"label": label, "us": t.median_us, "p10_us": t.p10_us, "p90_us": t.p90_us,
               "frac_copy": bound_us / t.median_us, **extra}
        results["rows"].append(row)
        print(f"{label:58s} {t.median_us:8.1f} us  {row['frac_copy']:6.1%}  (p10 {t.p10_us:.1f}, p90 {t.p90_us:.1f})")
        return row

    if args.structure:
        structure_sweep(results, record, x, gs, fp4moe.quantize(x, "nvfp4", gs))
        results["wall_s"] = time.time() - t0
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sweep-quantize-structure-h200.json"), "w") as f:
            json.dump(results, f, indent=1)
        return
    if args.baseline and os.path.exists(args.baseline):
        base = baseline_fn(args.baseline)
        record("baseline kernel (HEAD) given 16x512 w8", lambda: base(x, gs), kind="baseline", scale="given")
    heur = QuantizeConfig.from_heuristic(M, K)
    record(f"new heuristic {heur} given", lambda: quantize_activations(x, gs), kind="new", scale="given",
           config=str(heur))
    sweep = [(16, 512, 8), (8, 512, 4), (4, 512, 2), (2, 512, 1), (1, 1024, 1), (4, 256, 1), (8, 256, 2),
             (2, 1024, 2), (1, 2048, 2), (4, 1024, 4), (4, 512, 1), (2, 256, 1), (1, 512, 1)]
    if args.wide:
        sweep = [(1, 2048, 2), (1, 4096, 4), (2, 2048, 4), (1, 2048, 1), (1, 1024, 1), (2, 4096, 8)]
    best = None
    want = fp4moe.quantize(x, "nvfp4", gs)
    for bm, bk, nw in sweep:
        cfg = QuantizeConfig(bm, bk, nw)
        try:
            ok = same(quantize_activations(x, gs, config=cfg), want)  # every timed tile is also checked
            results["checks"].append({"case": f"bf16 [{M}, {K}] given (timing input)", "config": str(cfg), "ok": ok})
            if not ok:
                print(f"MISMATCH: timing input config={cfg}")
            row = record(f"config {bm}x{bk} w{nw} ({bm * bk // (32 * nw)} elem/thread) given",
                         lambda: quantize_activations(x, gs, config=cfg), kind="new", scale="given", config=str(cfg))
        except Exception as e:  # noqa: BLE001 - a sweep reports and continues
            print(f"config {cfg}: ERROR {type(e).__name__}: {str(e)[:200]}")
            continue
        if best is None or row["us"] < best[1]:
            best = (cfg, row["us"])
    print(f"best given-scale config: {best[0]} {best[1]:.1f} us = {bound_us / best[1]:.1%} of copy")
    results["best_given"] = {"config": str(best[0]), "us": best[1], "frac_copy": bound_us / best[1]}
    # dynamic global scale: absmax pass + quantize pass
    record(f"new heuristic {heur} dynamic", lambda: quantize_activations(x, None), kind="new", scale="dynamic",
           config=str(heur))
    for steps in (1, 8):
        with tuning(quantize=dict(absmax_row_steps=steps)):
            for cfg in dict.fromkeys([heur, best[0]]):
                record(f"{cfg} dynamic absmax ROW_STEPS={steps}", lambda: quantize_activations(x, None, config=cfg),
                       kind="new", scale="dynamic", config=str(cfg), absmax_row_steps=steps)
    results["wall_s"] = time.time() - t0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep-quantize" + ("-wide" if args.wide else "") + "-h200.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"done in {results['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
