"""Time of the MoE dispatch plan (``fp4moe.ops.dispatch``) per configuration, GLM-5 and Qwen3-MoE
expert counts, decode to prefill token counts, under CUDA-graph replay; and the router alone
(GLM-5's sigmoid + grouped top-k). GPU only.
Usage: PYTHONPATH=src python3 tools/sweep/sweep_dispatch.py [--tokens 1,2,...] [--out DIR]"""
import json
import sys

import torch

from fp4moe.bench.moe import _router
from fp4moe.bench.timing import time_cuda_graph
from fp4moe.models import get_model
from fp4moe.ops.dispatch import DispatchConfig, dispatch

out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
tokens = [int(t) for t in sys.argv[sys.argv.index("--tokens") + 1].split(",")] if "--tokens" in sys.argv \
    else [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024]
res = []
for E, k in ((256, 8), (128, 8)):
    for T in tokens:
        ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)]).to(torch.int32)
        default = DispatchConfig.from_heuristic(T * k, E)
        cfgs = [default] + [DispatchConfig(bp, fused, w) for fused in (True, False) for bp in (16, 32, 64, 128, 256, 512)
                            for w in (4, 8) if not (fused and T * k > 2048)]
        for c in dict.fromkeys(cfgs):
            t = time_cuda_graph(lambda: dispatch(ids, E, 8, config=c), iters_per_graph=20, reps=10).median_us
            res.append(dict(E=E, T=T, cfg=str(c), default=c == default, us=t))
        best = min((r for r in res if r["E"] == E and r["T"] == T), key=lambda r: r["us"])
        dflt = next(r for r in res if r["E"] == E and r["T"] == T and r["default"])
        print(f"E={E} T={T}: default {dflt['cfg']} {dflt['us']:.2f} us, best {best['cfg']} {best['us']:.2f} us", flush=True)
route = _router(get_model("glm-5"))
for T in tokens:
    logits = torch.randn(T, 256, device="cuda")
    t = time_cuda_graph(lambda: route(logits, None), iters_per_graph=20, reps=10).median_us
    res.append(dict(router="glm-5", T=T, us=t))
    print(f"router glm-5 T={T}: {t:.2f} us", flush=True)
if out_dir:
    with open(f"{out_dir}/sweep-dispatch-h200.json", "w") as f:
        json.dump(res, f, indent=1)
