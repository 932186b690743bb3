"""Launches of the NVFP4 activation quantizer for ncu (profiling only): bf16 [16384, 6144] with a
given global scale, the heuristic's configuration and the same tile without its register cap."""
import dataclasses

import torch

from fp4moe.ops.quantize import QuantizeConfig, quantize_activations
from fp4moe.quantize import nvfp4_global_scale

x = torch.randn(16384, 6144, device="cuda", dtype=torch.bfloat16)
gs = nvfp4_global_scale(x.abs().amax())
heuristic = QuantizeConfig.from_heuristic(*x.shape, x.dtype)
for cfg in (heuristic, dataclasses.replace(heuristic, maxnreg=None)):
    for _ in range(3):
        quantize_activations(x, gs, config=cfg)
torch.cuda.synchronize()
