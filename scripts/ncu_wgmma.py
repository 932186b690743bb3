"""Launches of the wgmma linear kernel for ncu (profiling only): ``python scripts/ncu_wgmma.py [M [N K]]``
(default M=4096 on 12288x6144), with the configuration the runtime picks (``choose_wgmma_config``);
several weights rotate so that the small-M launches read from HBM, not L2."""
import sys

import torch

from fp4moe.ops.mma_layout import choose_wgmma_config, launch_linear_wgmma, pack_mma
from fp4moe.quantize import quantize

M = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
N, K = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (12288, 6144)
ws = [pack_mma(quantize(torch.randn(N, K, device="cuda"), "nvfp4")) for _ in range(4)]
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
cfg = choose_wgmma_config(M, N, K)
print(cfg)
for i in range(6):
    launch_linear_wgmma(x, ws[i % 4], None, y, cfg)
torch.cuda.synchronize()
