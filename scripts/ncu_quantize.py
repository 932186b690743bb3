import torch
from fp4moe.ops.quantize import QuantizeConfig, quantize_activations
from fp4moe.quantize import nvfp4_global_scale
x = torch.randn(16384, 6144, device="cuda", dtype=torch.bfloat16)
gs = nvfp4_global_scale(x.abs().amax())
for cfg in (QuantizeConfig(1, 2048, 2), QuantizeConfig(1, 2048, 2, 8)):
    for _ in range(3):
        quantize_activations(x, gs, config=cfg)
torch.cuda.synchronize()
