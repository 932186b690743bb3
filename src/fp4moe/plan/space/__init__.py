"""The kernel registry: for every kernel family, what can be tuned and what it costs.

A ``KernelSpec`` (``space.base``) ties together, for one family of kernels:

* the problem it solves (a frozen dataclass, e.g. ``LinearProblem``) and its configuration type
  (e.g. ``ops.linear.LinearConfig``);
* ``candidates(problem, arch)``: the configurations worth considering;
* ``heuristic(problem, arch, sm_count)``: what the runtime picks without tuning;
* ``smem_model(config, problem, arch)``: shared memory, term by term (``target.smem``);
* ``compile_request(config, problem, arch)``: how to cross-compile it (``plan.crosscompile``);
* ``expected_mma(problem, arch)``: the MMA instruction the PTX must contain;
* ``model_time(config, problem, gpu)``: a roofline estimate (bytes over bandwidth against
  FLOPs over peak, with waves over the SM count and the split-K reduction).

Registered, one module per family or related group:

* ``space.linear``: ``fp4_linear`` (paths w4a16, w4a4_emulated, w4a4_native);
* ``space.packed_linear``: ``fp4_linear_mma`` (W4A16 decode on weights in MMA operand order,
  ``kernels.linear_mma``, Gluon) and ``fp4_linear_wgmma`` (the SM90 prefill kernel on weights in
  MMA operand order, ``kernels.gemm_wgmma``, Gluon), on what ``space.packed`` shares;
* ``space.quantize``: ``nvfp4_quantize``, ``nvfp4_dequantize`` (emulated W4A4's activations back
  to bf16), ``nvfp4_weight_dequantize`` (a weight to bf16 for large-batch W4A16 on SM90, whose
  GEMM is torch's matmul);
* ``space.moe``: ``fp4_moe_gemm`` (the MoE layer's two grouped GEMMs, ``kernels.moe.moe_gemm_kernel``);
* ``space.packed_moe``: ``fp4_moe_mma`` and ``fp4_moe_wgmma`` (the same GEMMs on the mma.sync
  kernel at decode and on the wgmma kernel at SM90 prefill).

Later kernels add a spec with ``register``. Nothing here imports Triton or torch at import time.
"""

from __future__ import annotations

from ...target import default_gpu
from .base import (KERNEL_US, KERNELS, L2_BANDWIDTH_FACTOR, SECOND_KERNEL_US, KernelSpec, MmaExpectation, TimeEstimate,
                   get_kernel, register)
from .linear import LinearProblem, LinearSpec
from .moe import MoEGemmProblem, MoEGemmSpec
from .packed_linear import MmaLinearSpec, WgmmaLinearSpec
from .packed_moe import MmaMoESpec, WgmmaMoESpec
from .quantize import (DequantizeProblem, DequantizeSpec, QuantizeProblem, QuantizeSpec, WeightDequantizeProblem,
                       WeightDequantizeSpec, _jit_parameters)

__all__ = [
    "KERNELS",
    "KERNEL_US",
    "L2_BANDWIDTH_FACTOR",
    "SECOND_KERNEL_US",
    "KernelSpec",
    "LinearProblem",
    "LinearSpec",
    "MmaExpectation",
    "MmaLinearSpec",
    "MmaMoESpec",
    "WgmmaLinearSpec",
    "WgmmaMoESpec",
    "MoEGemmProblem",
    "MoEGemmSpec",
    "QuantizeProblem",
    "QuantizeSpec",
    "DequantizeProblem",
    "DequantizeSpec",
    "WeightDequantizeProblem",
    "WeightDequantizeSpec",
    "TimeEstimate",
    "default_gpu",
    "get_kernel",
    "register",
]

# KERNELS keeps this order
register(LinearSpec())
register(MmaLinearSpec())
register(WgmmaLinearSpec())
register(QuantizeSpec())
register(DequantizeSpec())
register(WeightDequantizeSpec())
register(MoEGemmSpec())
register(MmaMoESpec())
register(WgmmaMoESpec())
