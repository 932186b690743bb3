"""Per-kernel CUDA time of the GLM-5 MoE layer as ``fp4moe bench moe`` runs it (routing, dispatch,
the grouped GEMMs and their epilogues, combine), under CUDA-graph replay, against the layer's time
per call. GPU only.
Usage: PYTHONPATH=src python3 tools/profile/profile_moe.py [--tokens 1,16,4096]"""
import sys

import torch

from fp4moe.bench.moe import _router, random_experts
from fp4moe.bench.timing import kernel_times, time_cuda_graph
from fp4moe.models import get_model
from fp4moe.ops.moe import moe_experts

tokens = [int(t) for t in sys.argv[sys.argv.index("--tokens") + 1].split(",")] if "--tokens" in sys.argv else [4096, 1024]
spec = get_model("glm-5")
E, H, I = spec.n_experts, spec.hidden, spec.expert_intermediate
gen = torch.Generator(device="cuda").manual_seed(0)
w13, w2 = random_experts(E, H, I, spec.fmt, gen)
route = _router(spec)
for T in tokens:
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(T, E, device="cuda", dtype=torch.float32, generator=gen)
    fn = lambda: moe_experts(x, w13, w2, *route(logits, None)[:2])  # noqa: E731
    total = time_cuda_graph(fn, iters_per_graph=10, reps=15).median_us
    times = kernel_times(fn, calls=10)
    print(f"T={T}: {total:.1f} us per call, kernels {sum(times.values()):.1f} us", flush=True)
    for name, us in times.items():
        print(f"  {us:9.2f} us  {name}", flush=True)
