"""A/B measurement of the whole MoE layer (``ops.moe.moe_experts``) with the experts' packed words in
the nibble bit order (``ops.mma_pack.WORD_ORDERS``, 13 integer operations per decoded word) and in
the rotation order (9 operations), on two copies of the same experts packed each way
(``MoETuning.word_order`` set while packing; the kernels decode each pack in its own order), timed
interleaved under CUDA graphs, outputs compared bitwise. ``--configs``: each order on each of these
decode configurations (``MMAConfig`` names) in place of ``ops.moe.mma_moe_layer_config``'s choice.
GPU only.
Usage: PYTHONPATH=src python3 tools/moe_decode/try_moe_decode_order.py [--model glm-5] [--tokens 1,16,256]
       [--configs mma_n64_m8_k256_w4,mma_n64_m8_k128_w4_split2] [--out DIR]"""
import argparse
import json
import os

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,16,64,128,192,256")
    ap.add_argument("--configs", default="")
    ap.add_argument("--model", default="glm-5")
    ap.add_argument("--out")
    args = ap.parse_args()
    from fp4moe.bench.timing import time_cuda_graphs
    from fp4moe.ops import moe as moe_ops
    from fp4moe.ops import moe_packed
    from fp4moe.tuning import tuning
    from fp4moe.ops.mma_sync import MMAConfig
    from fp4moe.quantize import FP4Tensor
    from moe_decode_setup import decode_experts

    ex = decode_experts(args.model)

    def packed_copy(order):
        w13, w2 = (FP4Tensor(w.data.clone(), w.scales.clone(),
                             None if w.global_scale is None else w.global_scale.clone(), w.shape, w.fmt)
                   for w in (ex.w13, ex.w2))
        with tuning(moe=dict(word_order=order)):
            assert moe_ops.mma_packed_experts(w13).order == moe_ops.mma_packed_experts(w2).order == order
        return w13, w2

    orders = {o: packed_copy(o) for o in ("nibble", "rotation")}
    chosen = moe_packed.mma_moe_layer_config
    configs = [c for c in args.configs.split(",") if c] or [None]
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x, ids, wts = ex.batch(T)

        def layer(order, cfg):
            w13, w2 = orders[order]

            def run():
                moe_packed.mma_moe_layer_config = chosen if cfg is None else (lambda *a: MMAConfig.parse(cfg))
                return moe_ops.moe_experts(x, w13, w2, ids, wts)
            return run

        fns = {f"{o}:{c or 'default'}": layer(o, c) for c in configs for o in orders}
        outs = {name: fn() for name, fn in fns.items()}
        res = {n: r.median_us for n, r in time_cuda_graphs(fns, iters_per_graph=10, reps=15).items()}
        same = all(torch.equal(outs[f"nibble:{c or 'default'}"], outs[f"rotation:{c or 'default'}"]) for c in configs)
        row = dict(T=T, bitwise=same, us=res)
        print(T, row["bitwise"], {k: round(v, 1) for k, v in sorted(res.items(), key=lambda kv: kv[1])}, flush=True)
        rows.append(row)
    moe_packed.mma_moe_layer_config = chosen
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = ("-configs" if args.configs else "") + ("" if args.model == "glm-5" else f"-{args.model}")
        with open(f"{args.out}/try-moe-decode-order{tag}-h200.json", "w") as f:
            json.dump(dict(about=__doc__.splitlines()[0], configs=configs, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
