"""Launches of the W4A16 decode kernel (the runtime's configuration, ``choose_mma_config``) for
ncu (profiling only): ``python scripts/ncu_decode.py M [N K]`` (default 12288x6144); several
weights rotate so that every launch reads from HBM, and the profiled launches sit between
``cudaProfilerStart``/``Stop`` (``ncu --profile-from-start off``)."""
import sys

import torch

from fp4moe.ops.mma_layout import choose_mma_config, launch_linear_mma, pack_mma
from fp4moe.quantize import quantize

M = int(sys.argv[1]) if len(sys.argv) > 1 else 16
N, K = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (12288, 6144)
ws = [pack_mma(quantize(torch.randn(N, K, device="cuda"), "nvfp4")) for _ in range(4)]
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
cfg = choose_mma_config(M, N, K)
print(cfg, flush=True)
for i in range(8):
    launch_linear_mma(x, ws[i % 4], None, y, cfg)
torch.cuda.synchronize()
torch.cuda.profiler.start()
for i in range(2):
    launch_linear_mma(x, ws[i % 4], None, y, cfg)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
