"""One launch of the wgmma prefill kernel at 12288x6144, M=4096, for ncu (profiling only)."""
import torch
from fp4moe.quantize import quantize
from fp4moe.ops.mma_layout import pack_mma, launch_linear_wgmma, WgmmaConfig
N, K, M = 12288, 6144, 4096
p = pack_mma(quantize(torch.randn(N, K, device="cuda"), "nvfp4"))
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    launch_linear_wgmma(x, p, None, y, WgmmaConfig())
torch.cuda.synchronize()
