"""Emulated W4A4 (GPUs without FP4 MMA) at decode: x (and the MoE's h) quantized to NVFP4 and back
to bf16 by one kernel (``fake_quantize_activations``, session 15) against the two kernels before it
(``quantize_activations`` then ``dequantize_activations``), and a dynamic scale's absmax pass
leaving per-program maxima (no zero fill; ``absmax_partials``) against one atomic word, with W4A16
on the same weights, all timed with their replays interleaved (``time_cuda_graphs``). GPU only.
Usage: PYTHONPATH=src python3 scripts/sweep_w4a4_chain.py [--out DIR] [--ms 1,4,16] [--moe-ms 1,4,16]
  [--shapes NxK,...] [--tag NAME] (the JSON's name: sweep-w4a4-chain[-NAME]-h200.json)"""
import argparse
import contextlib
import json
import os

import torch

import fp4moe.ops.quantize as opsq
from fp4moe.bench.moe import random_experts
from fp4moe.bench.timing import l2_bytes, rotating, rotation_count, time_cuda_graphs
from fp4moe.models import get_model
from fp4moe.ops.linear import fp4_linear, mma_packed
from fp4moe.ops.moe import moe_experts
from fp4moe.quantize import nvfp4_global_scale, quantize

FUSED = opsq.fake_quantize_activations


def _two_kernels(x, global_scale=None, weight_global_scale=None, *, k_stored=None, config=None):
    return opsq.dequantize_activations(opsq.quantize_activations(x, global_scale), weight_global_scale,
                                       k_stored=k_stored)


PARTIALS = opsq.MAX_ABSMAX_PARTIALS

#: variant -> (one kernel, absmax partials)
VARIANTS = {"w4a4_fused": (True, True), "w4a4_two_kernels": (False, True),
            "w4a4_fused_atomic_amax": (True, False)}


@contextlib.contextmanager
def chain(fused: bool, partials: bool = True):
    """The runtime's fake quantization as one kernel (fused) or as the two kernels before it; a
    dynamic scale's maxima as per-program partials or one atomic word."""
    opsq.fake_quantize_activations = FUSED if fused else _two_kernels
    opsq.MAX_ABSMAX_PARTIALS = PARTIALS if partials else 0
    try:
        yield
    finally:
        opsq.fake_quantize_activations = FUSED
        opsq.MAX_ABSMAX_PARTIALS = PARTIALS


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--moe-ms", default="1,4,16")
    ap.add_argument("--shapes", default="12288x6144,6144x12288,4096x6144,6144x2048")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "linear": [], "moe": []}
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        w0 = quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen), "nvfp4")
        ws = [w0] + [quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen), "nvfp4")
                     for _ in range(rotation_count(w0.data.numel() + w0.scales.numel(), l2_bytes()) - 1)]
        for w in ws:
            mma_packed(w)
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            for scale in ("given", "dynamic"):
                gs = nvfp4_global_scale(x.abs().amax()) if scale == "given" else None
                fns = {}
                for name in ("w4a16", *VARIANTS):
                    if name == "w4a4_fused_atomic_amax" and gs is not None:
                        continue  # no absmax pass with a given scale
                    kw = {} if name == "w4a16" else {"mode": "w4a4", "input_global_scale": gs}
                    call = rotating(lambda q, kw=kw: fp4_linear(x, q, **kw), [(q,) for q in ws])
                    with chain(*VARIANTS.get(name, (True, True))):
                        for q in ws:
                            fp4_linear(x, q, **kw)
                    fns[name] = _in(call, *VARIANTS.get(name, (True, True)))
                t = time_cuda_graphs(fns, iters_per_graph=max(20, len(ws)), reps=20)
                row = dict(shape=shape, M=M, scale=scale, **{k: v.median_us for k, v in t.items()})
                res["linear"].append(row)
                print(json.dumps(row), flush=True)
    spec = get_model("glm-5")
    E, k, H, I = spec.n_experts, spec.routing.top_k, spec.hidden, spec.expert_intermediate
    w13, w2 = random_experts(E, H, I, "nvfp4", gen, pack=True)
    for T in map(int, args.moe_ms.split(",")):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        gs = nvfp4_global_scale(x.abs().amax())
        sets = []
        for _ in range(4):  # four routings, as the MoE bench cycles through
            ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:k] for _ in range(T)]).to(torch.int32)
            sets.append((ids, torch.softmax(torch.randn(T, k, device="cuda", generator=gen), -1)))
        fns = {}
        for name in ("w4a16", *VARIANTS):  # h's scale is dynamic: the absmax variants differ here too
            kw = {} if name == "w4a16" else {"mode": "w4a4", "input_global_scale": gs}
            call = rotating(lambda i, wt, kw=kw: moe_experts(x, w13, w2, i, wt, **kw), sets)
            with chain(*VARIANTS.get(name, (True, True))):
                for s in sets:
                    moe_experts(x, w13, w2, *s, **kw)
            fns[name] = _in(call, *VARIANTS.get(name, (True, True)))
        t = time_cuda_graphs(fns, iters_per_graph=20, reps=20)
        row = dict(model="glm-5", T=T, **{k2: v.median_us for k2, v in t.items()})
        res["moe"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        stem = "sweep-w4a4-chain" + (f"-{args.tag}" if args.tag else "")
        with open(os.path.join(args.out, f"{stem}-h200.json"), "w") as f:
            json.dump(res, f, indent=1)


def _in(call, fused, partials=True):
    def fn():
        with chain(fused, partials):
            return call()
    return fn


if __name__ == "__main__":
    main()
