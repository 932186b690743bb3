"""Hardware-target facts that both the runtime (``fp4moe.ops``) and the planner (``fp4moe.plan``)
need; this package sits below both and imports neither (nor ``fp4moe.bench``).

Public API (re-exported here): the GPU catalogue (``catalogue``: ``Arch``, ``GPU``, ``ARCHS``,
``GPUS``, ``default_gpu``) and its resolution and detection (``resolve``: ``get_arch``,
``arch_for_capability``, ``find_gpu``, ``resolve_target``, ``emulation_gaps``, ``detect``,
``compare``, ``Detected``, ``as_dict``).

Submodules, imported from where they live:

* ``fp4moe.target.compile_request``: ``CompileRequest``, what to cross-compile for a target
  (``fp4moe.plan.crosscompile`` compiles it);
* ``fp4moe.target.smem``: ``SmemBreakdown``, ``SmemTerm``, ``linear_family``, ``linear_smem``,
  ``quantize_smem``, ``moe_smem``, the shared-memory model (the MoE model is a measured table,
  ``moe_smem_measured.json``, with a safe upper bound elsewhere);
* ``fp4moe.target.roofline``: bytes, FLOPs and lower bounds on time (pure arithmetic).
"""

from .catalogue import ARCHS, BF16MMA, FP4MMA, GPU, GPUS, Arch, default_gpu
from .resolve import (Detected, arch_for_capability, as_dict, compare, detect, emulation_gaps, find_gpu, get_arch,
                     resolve_target)

__all__ = [
    "ARCHS",
    "BF16MMA",
    "FP4MMA",
    "GPUS",
    "Arch",
    "Detected",
    "GPU",
    "arch_for_capability",
    "as_dict",
    "compare",
    "default_gpu",
    "detect",
    "emulation_gaps",
    "find_gpu",
    "get_arch",
    "resolve_target",
]
