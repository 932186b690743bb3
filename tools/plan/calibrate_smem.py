"""Check the shared-memory model (fp4moe.target.smem) against cross-compiled kernels, on a grid.

The model's fitted terms (per-thread scratch budgets, measured conversion tables) are Triton
3.6's; after a Triton upgrade, run this and refit what drifted. Compilations are cached
(FP4MOE_CACHE_DIR), so a second run only compiles what changed. CPU only.

    PYTHONPATH=src python tools/plan/calibrate_smem.py                 # every family, ~2,000 kernels
    PYTHONPATH=src python tools/plan/calibrate_smem.py --cc 120 --quick --show-misfits

Prints, per (path, cc, format, dtype, split), how many configurations the model gets exact
(within 16 B), within the tolerance (5% or 1 KiB), and the worst difference.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import sys

from fp4moe.target import get_arch
from fp4moe.ops.linear import LinearConfig, target_path
from fp4moe.plan.cache import CompileCache
from fp4moe.plan.crosscompile import cross_compile
from fp4moe.plan.space import LinearProblem, get_kernel


def grid(ccs: list[int], quick: bool):
    ns, ms = (64, 128), ((16, 64, 256) if quick else (16, 32, 64, 128, 256))
    ks, ws = ((128, 256) if quick else (64, 128, 256)), (4, 8)
    stages = (1, 3) if quick else (1, 2, 3, 4)
    for cc in ccs:
        arch = get_arch(cc)
        paths = {"w4a16", target_path("w4a4", arch)}
        for path, n, m, k, w, s in itertools.product(sorted(paths), ns, ms, ks, ws, stages):
            if path == "w4a4_native" and arch.fp4_mma == "tcgen05" and n != 128:
                continue  # does not compile: tcgen05's FP4 MMA is 128 rows tall
            mode = "w4a16" if path == "w4a16" else "w4a4"
            splits = (1, 2) if m <= 64 and s in (1, 3) else (1,)
            for sk in splits:
                yield cc, LinearProblem(4096, 6144, 6144, mode=mode), LinearConfig(n, m, k, w, s, sk)
            if path == "w4a16" and s in (1, 3) and m in (16, 64, 256):
                yield cc, LinearProblem(4096, 6144, 6144, fmt="mxfp4"), LinearConfig(n, m, k, w, s)
                yield cc, LinearProblem(4096, 6144, 6144, x_dtype="fp16"), LinearConfig(n, m, k, w, s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cc", type=int, action="append", help="compute capabilities (default 80 89 90 100 120)")
    ap.add_argument("--quick", action="store_true", help="a coarser grid")
    ap.add_argument("--jobs", type=int, default=None, help="compiler processes (default: one per core)")
    ap.add_argument("--show-misfits", action="store_true", help="list configurations outside the tolerance")
    ap.add_argument("--json", help="write every (configuration, model, compiled) row to this file")
    args = ap.parse_args()
    ccs = args.cc or [80, 89, 90, 100, 120]
    spec = get_kernel("fp4_linear")
    cases = list(grid(ccs, args.quick))
    print(f"compiling {len(cases)} configurations (cached ones are free) ...", file=sys.stderr)
    results = cross_compile([spec.compile_request(c, p, get_arch(cc)) for cc, p, c in cases], jobs=args.jobs,
                            cache=CompileCache())
    stats = collections.defaultdict(lambda: [0, 0, 0, 0])
    rows = []
    for (cc, problem, cfg), r in zip(cases, results):
        if not r.ok:
            continue
        arch = get_arch(cc)
        model = spec.smem_model(cfg, problem, arch)
        d = model.total - r.shared
        key = (problem.path_on(arch), cc, problem.fmt, problem.x_dtype, "split" if cfg.split_k > 1 else "")
        st = stats[key]
        st[0] += 1
        st[1] += abs(d) <= 16
        ok = abs(d) <= max(1024, 0.05 * r.shared)
        st[2] += ok
        st[3] = max(st[3], abs(d))
        rows.append({"cc": cc, "problem": str(problem), "config": str(cfg), "model": model.total,
                     "compiled": r.shared, "buffers": list(r.smem_buffers), "terms": model.as_dict()["terms"]})
        if args.show_misfits and not ok:
            print(f"  misfit sm{cc} {problem} {cfg}: model {model.total:,} B, compiled {r.shared:,} B "
                  f"({model.describe()}; buffers {list(r.smem_buffers)})")
    total = [0, 0, 0]
    for key in sorted(stats):
        n, exact, within, worst = stats[key]
        total = [total[0] + n, total[1] + exact, total[2] + within]
        print(f"{key}: {n} configs, exact {exact}, within tolerance {within}, worst |model - compiled| {worst:,} B")
    print(f"all: {total[0]} configs, exact {total[1]}, within tolerance {total[2]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if total[2] == total[0] else 1


if __name__ == "__main__":
    sys.exit(main())
