"""The GLM-5 MoE layer's grouped GEMMs for ncu (profiling only): ``python tools/ncu/ncu_moe.py T``
builds the layer at T tokens (uniform routing), warms it up, then runs one call between
``cudaProfilerStart``/``Stop``: profile with ``ncu --profile-from-start off -k regex:fp4_linear_mma``.
Usage: FP4MOE_PDL=0 ncu --clock-control none --profile-from-start off -k regex:fp4_linear_mma
--section SpeedOfLight ... python3 tools/ncu/ncu_moe.py 256"""
import sys

import torch

from fp4moe.bench.moe import _router, random_experts
from fp4moe.models import get_model
from fp4moe.ops.moe import moe_experts

T = int(sys.argv[1]) if len(sys.argv) > 1 else 256
spec = get_model("glm-5")
E, H, I = spec.n_experts, spec.hidden, spec.expert_intermediate
gen = torch.Generator(device="cuda").manual_seed(0)
w13, w2 = random_experts(E, H, I, spec.fmt, gen)
route = _router(spec)
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
logits = torch.randn(T, E, device="cuda", dtype=torch.float32, generator=gen)
for _ in range(3):
    moe_experts(x, w13, w2, *route(logits, None)[:2])
torch.cuda.synchronize()
torch.cuda.profiler.start()
moe_experts(x, w13, w2, *route(logits, None)[:2])
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print("T", T, "done")
