"""The MoE decode chain's small kernels, per configuration, under CUDA-graph replay (each launch
with PDL where the GPU has it, as the layer runs them): GLM-5 routing (sigmoid + bias, top-8 of
256) by tokens per program and warps, and the one-program dispatch (all pairs in one vector) by
warps against the default configuration. GPU only.
Usage: PYTHONPATH=src python3 tools/sweep/sweep_chain.py [--out DIR]"""
import json
import sys

import torch

from fp4moe.bench.timing import time_cuda_graph
from fp4moe.models import get_model
from fp4moe.ops.dispatch import DispatchConfig, dispatch
from fp4moe.ops.routing import RoutingConfig, route

out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
spec = get_model("glm-5")
E, k = spec.n_experts, spec.routing.top_k
bias = torch.randn(E, device="cuda") * 0.1
res = []


def timed(fn):
    return time_cuda_graph(fn, iters_per_graph=20, reps=10).median_us


for T in (1, 2, 4, 8, 16, 64, 256):
    logits = torch.randn(T, E, device="cuda")
    default = RoutingConfig.from_heuristic(T, E, k)
    cfgs = [default] + [RoutingConfig(bt, w) for bt in (1, 2, 4, 8) if bt <= max(T, 1) for w in (1, 2, 4)]
    for c in dict.fromkeys(cfgs):
        us = timed(lambda: route(logits, spec.routing, bias, config=c))
        res.append(dict(kernel="routing", T=T, cfg=str(c), default=c == default, us=us))
    rows = [r for r in res if r["kernel"] == "routing" and r["T"] == T]
    best, dflt = min(rows, key=lambda r: r["us"]), next(r for r in rows if r["default"])
    print(f"routing T={T}: default {dflt['cfg']} {dflt['us']:.2f} us, best {best['cfg']} {best['us']:.2f} us",
          flush=True)

for T in (4096, 16384):  # prefill: one token per program against the earlier 8 per program
    logits = torch.randn(T, E, device="cuda")
    for c in (RoutingConfig.from_heuristic(T, E, k), RoutingConfig(8, 4)):
        us = timed(lambda: route(logits, spec.routing, bias, config=c))
        res.append(dict(kernel="routing", T=T, cfg=str(c), default=c == RoutingConfig.from_heuristic(T, E, k), us=us))
        print(f"routing T={T} {c}: {us:.2f} us", flush=True)

# dispatch: the one-vector kernel (fused, block_p >= pairs) by warps, against the default
for T in (1, 2, 4, 8, 16):
    ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)]).to(torch.int32)
    default = DispatchConfig.from_heuristic(T * k, E)
    block_p = max(16, 1 << (T * k - 1).bit_length())
    for c in dict.fromkeys([default] + [DispatchConfig(block_p, True, w) for w in (2, 4, 8)]):
        us = timed(lambda: dispatch(ids, E, 8, config=c))
        res.append(dict(kernel="dispatch", T=T, cfg=str(c), default=c == default, us=us))
        print(f"dispatch T={T} {c}{' (default)' if c == default else ''}: {us:.2f} us", flush=True)

if out_dir:
    with open(f"{out_dir}/sweep-chain-h200.json", "w") as f:
        json.dump(res, f, indent=1)
