"""Mid batch sizes (M = 24..128) on the four GLM-5 linear shapes: the Triton W4A16 kernel vs the
wgmma kernel by configuration (where WGMMA_MIN_M comes from). GPU only.
Usage: PYTHONPATH=src python3 scripts/sweep_wgmma_mid_m.py"""
import torch
from fp4moe.formats import NVFP4
from fp4moe.quantize import quantize
from fp4moe.ops.linear import launch_linear, choose_config, device_arch
from fp4moe.ops.mma_layout import pack_mma, launch_linear_wgmma, WgmmaConfig
from fp4moe.bench.timing import time_cuda_graph
arch = device_arch(torch.device("cuda"))
for (N, K) in [(12288, 6144), (6144, 12288), (4096, 6144), (6144, 2048)]:
    w = quantize(torch.randn(N, K, device="cuda"), NVFP4); p = pack_mma(w)
    for M in (24, 32, 48, 64, 96, 128):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16); y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        cfg = choose_config(M, N, K, path="w4a16", arch=arch)
        row = {"triton": time_cuda_graph(lambda: launch_linear(x, None, w, None, y, "w4a16", cfg), iters_per_graph=20, reps=10).median_us}
        for c in (WgmmaConfig(block_m=64, stages=4), WgmmaConfig(block_m=64, stages=6), WgmmaConfig(block_m=128, stages=4)):
            row[str(c)] = time_cuda_graph(lambda: launch_linear_wgmma(x, p, None, y, c), iters_per_graph=20, reps=10).median_us
        print(N, K, M, " ".join(f"{k}={v:.1f}" for k, v in row.items()), flush=True)
