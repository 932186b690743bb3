"""Per-kernel CUDA time of the GLM-5 MoE experts (fp4_moe_experts: dispatch, activation pass, the
two wgmma GEMMs, combine) at 4096 and 1024 tokens, by torch.profiler. GPU only.
Usage: PYTHONPATH=src python3 scripts/profile_moe.py"""
import torch, collections
from torch.profiler import profile, ProfilerActivity
from fp4moe.quantize import quantize, quantize_stacked
from fp4moe.ops import moe as moe_ops
E, k, H, I = 256, 8, 6144, 2048
dev = "cuda"
w13 = quantize_stacked(torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16), "nvfp4")
w2 = quantize(torch.randn(E, H, I, device=dev, dtype=torch.bfloat16), "nvfp4")
for T in (4096, 1024):
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    ids = torch.topk(torch.rand(T, E, device=dev), k, dim=-1).indices.to(torch.int32)
    wts = torch.rand(T, k, device=dev)
    for _ in range(3):
        moe_ops.fp4_moe_experts(x, w13, w2, ids, wts)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            moe_ops.fp4_moe_experts(x, w13, w2, ids, wts)
        torch.cuda.synchronize()
    tot = collections.Counter(); cnt = collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            tot[e.name[:60]] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            cnt[e.name[:60]] += 1
    print("T", T, "total us/call", sum(tot.values()) / 5)
    for n, v in tot.most_common(12):
        print(f"  {v/5:9.1f} us  x{cnt[n]//5}  {n}")
