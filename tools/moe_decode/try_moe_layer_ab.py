"""A/B measurement of the whole GLM-5 MoE layer (``ops.moe.moe_experts``: routing ids given,
dispatch -> GEMMs -> combine) under CUDA graphs with one tuning field (``fp4moe.tuning``, named
"family.field", e.g. "moe.heights_x_stages" or "dispatch.tiles_per_program") at two or more values,
timed interleaved in one process (one clock for all), outputs compared bitwise with the first
value's (equal only where the values sum in the same order).
GPU only.
Usage: PYTHONPATH=src python3 tools/moe_decode/try_moe_layer_ab.py --name moe.heights_x_stages --values 0,2
       [--tokens 64,128,192,256] [--out DIR]"""
import argparse
import json
import os

import torch

from fp4moe.ops import moe as moe_ops
from fp4moe.tuning import current_tuning, tuning


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--values", required=True,
                    help="Python literals, separated by ';' (or by ',' where none holds a comma)")
    ap.add_argument("--tokens", default="64,128,192,256")
    ap.add_argument("--out")
    args = ap.parse_args()
    import ast

    from fp4moe.bench.timing import time_cuda_graphs
    from moe_decode_setup import decode_experts

    values = [ast.literal_eval(v) for v in args.values.split(";" if ";" in args.values else ",")]
    family, _, name = args.name.partition(".")
    if not hasattr(current_tuning(), family) or not hasattr(getattr(current_tuning(), family), name):
        raise SystemExit(f"fp4moe.tuning has no field {args.name!r} (expected family.field, e.g. moe.pair_rows)")
    ex = decode_experts()
    w13, w2 = ex.w13, ex.w2
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x, ids, wts = ex.batch(T)

        def layer(v):
            def run():
                with tuning(**{family: {name: v}}):  # read at capture: each graph keeps its value
                    return moe_ops.moe_experts(x, w13, w2, ids, wts)
            return run

        outs = [layer(v)() for v in values]
        fns = {f"{args.name}={v}": layer(v) for v in values}
        res = {kk: vv.median_us for kk, vv in time_cuda_graphs(fns, iters_per_graph=10, reps=15).items()}
        row = dict(T=T, bitwise=all(bool(torch.equal(outs[0], o)) for o in outs[1:]), us=res,
                   max_rel_diff=max(float((o.float() - outs[0].float()).abs().max() / outs[0].float().abs().max())
                                    for o in outs[1:]))
        print(T, row["bitwise"], f"{row['max_rel_diff']:.2e}", {kk: round(vv, 1) for kk, vv in res.items()}, flush=True)
        rows.append(row)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(f"{args.out}/try-moe-layer-ab-{args.name.lower()}-h200.json", "w") as f:
            json.dump(dict(about=__doc__.splitlines()[0], name=args.name, values=values, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
