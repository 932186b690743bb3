"""Times named configurations of the packed W4A16 linear (``MMAConfig`` or ``WgmmaConfig`` names, as
benchmark records print them) on GLM-5 shapes, against the runtime's own choice, each checked
against the reference first. Weights rotate past the L2 as in ``fp4moe bench linear``; ``--repeat``
times every configuration R times round-robin. GPU only; ``--dry-run`` lists the runs (CPU).
``default_xs2``, ``default_pdl3``, ``default_pdl3_xs2``, ``default_xc``, ``default_xs2_xc``, ``default_xc_xa``
(x a chunk ahead, without the ring), ``default_pf2`` (weights two steps ahead into L2) name the runtime's
choice with those fields replaced. A name ending in ``@rotation`` times that configuration on the same
weights packed in the rotation bit order (``ops.mma_pack.WORD_ORDERS``; default: the linear's
nibble order). Checks record whether each output is bitwise the default's (None where the default
itself failed).
Usage: PYTHONPATH=src python3 tools/sweep/sweep_linear_configs.py --ms 16 --configs mma_n128_m16_k256_w4_split4_xs2,...
[--shapes 12288x6144,6144x12288] [--fmt nvfp4|mxfp4] [--repeat R] [--out DIR] [--dry-run]"""
import argparse
import json
import re
from dataclasses import replace

import torch

from fp4moe.ops.mma_sync import MMAConfig
from fp4moe.ops.wgmma import WgmmaConfig

SHAPES = "12288x6144,6144x12288,4096x6144,6144x2048"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="16")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--configs", required=True, help="comma-separated configuration names")
    ap.add_argument("--fmt", default="nvfp4", choices=("nvfp4", "mxfp4"))
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    names, orders = [], []
    for c in args.configs.split(","):
        name, _, order = c.partition("@")
        if order and order not in ("nibble", "rotation"):
            raise SystemExit(f"--configs: unknown bit order {order!r} in {c!r}")
        names.append(name)
        orders.append(order or "nibble")
    # the runtime's choice with fields replaced: default_pdl3, default_xs2, default_pdl3_xs2, default_xc, default_xc_xa (xs 0)
    variants = []
    for c, order in zip(names, orders):
        m = re.fullmatch(r"default(?:_pdl(\d))?(?:_xs(\d))?(_xc)?(_xa)?(?:_pf(\d))?", c)
        if m:
            variants.append(({k: int(v) for k, v in zip(("pdl", "xs"), m.groups()) if v is not None}
                             | ({"xc": True} if m[3] else {}) | ({"xc": True, "xa": True, "xs": 0} if m[4] else {})
                             | ({"pf": int(m[5])} if m[5] else {}), order))
    try:
        named = [(WgmmaConfig.parse(c) if c.startswith("wgmma_") else MMAConfig.parse(c), order)
                 for c, order in zip(names, orders) if not c.startswith("default")]
    except ValueError as err:
        raise SystemExit(f"--configs: {err}") from None
    if args.dry_run:
        for N, K in shapes:
            for M in ms:
                print(f"{N}x{K} M={M}: default, " + ", ".join(f"{c}@{o}" for c, o in named))
        return

    from fp4moe.bench.timing import l2_bytes, measure_copy_bandwidth, rotating, rotation_count, time_cuda_graph
    from fp4moe.formats import get_format
    from fp4moe.ops.linear import fp4_linear_reference, packed_config
    from fp4moe.ops.mma_pack import pack_mma
    from fp4moe.ops.mma_sync import launch_linear_mma
    from fp4moe.ops.wgmma import launch_linear_wgmma
    from fp4moe.target import get_arch
    from fp4moe.quantize import quantize

    arch = get_arch(torch.cuda.get_device_capability())
    copy = measure_copy_bandwidth()
    res = {"copy_gbs": copy, "time": [], "check": []}
    for N, K in shapes:
        fmt = get_format(args.fmt)
        w0 = quantize(torch.randn(N, K, device="cuda"), fmt)
        wbytes = w0.data.numel() + w0.scales.numel()
        bound = wbytes / (copy * 1e3)
        ws = [quantize(torch.randn(N, K, device="cuda"), fmt) for _ in range(rotation_count(wbytes, l2_bytes()))]
        packs = {o: [pack_mma(w, o) for w in ws] for o in {"nibble", *orders}}
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            ref = fp4_linear_reference(x, ws[0], None).float()
            base = packed_config("w4a16", arch, M, N, K, fmt=args.fmt, l2_bytes=l2_bytes())
            cfgs = [(base, "nibble")]
            for v, order in variants:
                try:
                    cfgs.append((replace(base, **v), order))
                except (TypeError, ValueError) as e:  # not an MMAConfig, or a field it refuses (pdl without kw)
                    print(f"{N}x{K} M={M} default with {v}: {e}", flush=True)
            cfgs += named
            y_default = None  # the default's output, which every configuration is compared with bitwise
            for rep in range(args.repeat):
                for c, order in cfgs:
                    ps = packs[order]
                    label = str(c) + ("" if order == "nibble" else f"@{order}")
                    first = (c, order) == cfgs[0]
                    launch = launch_linear_mma if isinstance(c, MMAConfig) else launch_linear_wgmma
                    try:
                        for p in ps:  # every weight launched once before capture (a pack's first launch waits)
                            launch(x, p, None, y, c)
                        if rep == 0:
                            y.fill_(float("nan"))
                            launch(x, ps[0], None, y, c)
                            err = float((y.float() - ref).abs().max() / ref.abs().max())
                            if first:
                                y_default = y.clone()
                            same = None if y_default is None else bool(torch.equal(y, y_default))
                            res["check"].append(dict(N=N, K=K, M=M, cfg=label, rel_err=err, ok=err < 1e-2,
                                                     bitwise_default=same))
                            if not err < 1e-2:
                                print(f"{N}x{K} M={M} {label}: WRONG rel_err {err:.2e}", flush=True)
                                continue
                        t = time_cuda_graph(rotating(lambda p, c=c, launch=launch: launch(x, p, None, y, c),
                                                     [(p,) for p in ps]), iters_per_graph=20, reps=10).median_us
                    except Exception as e:  # noqa: BLE001 - a sweep records what fails and goes on
                        print(f"{N}x{K} M={M} {label}: failed {e!r:.300}", flush=True)
                        continue
                    res["time"].append(dict(N=N, K=K, M=M, cfg=label, default=first, rep=rep, us=t,
                                            frac=bound / t))
                    same = next((r["bitwise_default"] for r in res["check"] if r["cfg"] == label and r["M"] == M
                                 and r["N"] == N and r["K"] == K), None)
                    print(f"{N}x{K} M={M} {label}{' (default)' if first else ''}: {t:.2f} us {bound / t:.1%}"
                          f"{'' if same in (True, None) else ' NOT BITWISE THE DEFAULT'}", flush=True)
        del ws, packs
    print("checks failed:", sum(not r["ok"] for r in res["check"]))
    if args.out:
        with open(f"{args.out}/sweep-linear-configs-h200.json", "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
