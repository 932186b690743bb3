"""Is the decode GEMMs' read pattern, or their bytes in flight, what holds them under the copy
bandwidth at one token? (GPU only.) Reads the bytes of GEMM 1 at one GLM-5 token (8 experts x
4096 x 6144 FP4 words: 1,024 programs of 4 warps, each warp 24 steps of 1 KB) with no arithmetic,
in two patterns: ``warp``: each warp streams its own contiguous run (as the grouped kernel's row
blocks); ``sweep``: at each step the warps' 1 KB pieces lie side by side. Each with D steps of
loads issued before any is used (D = 1, 2, 4), and ``db``: one step requested ahead (the kernel's
register double buffer). Against a plain copy of the same bytes: what one launch of such a grid
reaches with no arithmetic at all (the H200's numbers: docs/performance-engineering.md, the MoE
decode's limits).
Usage: PYTHONPATH=src python3 tools/probe/probe_stream_pattern.py [--steps 24] [--programs 1024]"""
import argparse

import torch
import triton
import triton.language as tl

WORDS = 256  # int32 per warp step (1 KB)


@triton.jit
def _addr(pid, j, s, n_steps, total_warps, SWEEP: tl.constexpr, WARPS: tl.constexpr):
    rep = j // (WARPS * 128)
    w = (j % (WARPS * 128)) // 128
    within = j % 128
    g = (pid * WARPS + w).to(tl.int64)
    if SWEEP:
        base = (s * total_warps + g) * 256
    else:
        base = (g * n_steps + s) * 256
    return base + rep * 128 + within


@triton.jit
def _stream(src, out, n_steps, SWEEP: tl.constexpr, D: tl.constexpr, DB: tl.constexpr, WARPS: tl.constexpr):
    pid = tl.program_id(0)
    total_warps = tl.num_programs(0) * WARPS
    j = tl.arange(0, WARPS * 256)
    acc = tl.zeros([WARPS * 256], dtype=tl.int32)
    if DB:
        a = tl.load(src + _addr(pid, j, 0, n_steps, total_warps, SWEEP, WARPS))
        for s in range(0, n_steps):
            b = tl.load(src + _addr(pid, j, tl.minimum(s + 1, n_steps - 1), n_steps, total_warps, SWEEP, WARPS))
            acc ^= a
            a = b
    else:
        for s0 in range(0, n_steps, D):
            for d in tl.static_range(D):
                acc ^= tl.load(src + _addr(pid, j, s0 + d, n_steps, total_warps, SWEEP, WARPS))
    tl.store(out + pid * WARPS * 256 + j, acc)


def main() -> None:
    from fp4moe.bench.timing import measure_copy_bandwidth, rotating, time_cuda_graphs

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--programs", type=int, default=1024)
    args = ap.parse_args()
    warps = 4
    n = args.programs * warps * WORDS * args.steps
    bufs = [torch.randint(0, 1 << 30, (n,), dtype=torch.int32, device="cuda") for _ in range(3)]
    out = torch.empty(args.programs * warps * WORDS, dtype=torch.int32, device="cuda")
    dst = torch.empty_like(bufs[0])
    copy_gbs = measure_copy_bandwidth()
    fns = {"copy (read + write)": rotating(lambda b: dst.copy_(b), [(b,) for b in bufs])}
    for sweep in (False, True):
        for d, db in ((1, False), (2, False), (4, False), (1, True)):
            if args.steps % d:  # batches of D steps: none may run past the program's run
                continue
            name = f"{'sweep' if sweep else 'warp'} {'db' if db else f'D={d}'}"
            fns[name] = rotating(lambda b, sweep=sweep, d=d, db=db: _stream[(args.programs,)](
                b, out, args.steps, SWEEP=sweep, D=d, DB=db, WARPS=warps, num_warps=warps), [(b,) for b in bufs])
    res = time_cuda_graphs(fns, iters_per_graph=12, reps=20)
    print(f"{n * 4 / 1e6:.1f} MB read; copy bandwidth {copy_gbs:.0f} GB/s (bound {n * 4 / copy_gbs / 1e3:.1f} us)")
    for name, r in res.items():
        nbytes = n * 4 * (2 if name.startswith("copy") else 1)
        print(f"  {name:22s} {r.median_us:8.1f} us  {nbytes / r.median_us / 1e3:7.0f} GB/s")


if __name__ == "__main__":
    main()
