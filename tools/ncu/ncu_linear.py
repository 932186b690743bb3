"""Launches of the W4A16 linear kernel the runtime runs at M rows (``ops.linear.packed_config``:
the mma.sync decode kernel up to MAX_M, the wgmma kernel from WGMMA_MIN_M on SM90) for ncu
(profiling only): ``python tools/ncu/ncu_linear.py [M [N K]]`` (default M = 16 on 12288x6144).
Four weights rotate so that every launch reads from HBM; the two profiled launches sit between
``cudaProfilerStart``/``Stop``: run under ``ncu --profile-from-start off -k regex:fp4_linear``."""
import sys

import torch

from fp4moe.ops.linear import device_arch, packed_config
from fp4moe.ops.mma_pack import pack_mma
from fp4moe.ops.mma_sync import launch_linear_mma, MMAConfig
from fp4moe.ops.wgmma import launch_linear_wgmma
from fp4moe.quantize import quantize

M = int(sys.argv[1]) if len(sys.argv) > 1 else 16
N, K = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (12288, 6144)
ws = [pack_mma(quantize(torch.randn(N, K, device="cuda"), "nvfp4")) for _ in range(4)]
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
cfg = packed_config("w4a16", device_arch(x.device), M, N, K, torch.cuda.get_device_properties(0).multi_processor_count)
if cfg is None:
    raise SystemExit(f"M={M}: the runtime runs the Triton kernel here, not a packed one")
launch = launch_linear_mma if isinstance(cfg, MMAConfig) else launch_linear_wgmma
print(cfg, flush=True)
for i in range(8):
    launch(x, ws[i % 4], None, y, cfg)
torch.cuda.synchronize()
torch.cuda.profiler.start()
for i in range(2):
    launch(x, ws[i % 4], None, y, cfg)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
