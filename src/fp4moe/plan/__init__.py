"""Planning before running: configuration spaces, cross-compilation for any target, and roofline
ranking, on the hardware facts of ``fp4moe.target`` (the catalogue, the shared-memory model, the
roofline arithmetic).

Public API (import from the submodules; importing ``fp4moe.plan`` itself loads nothing heavy):

* ``fp4moe.plan.planner``: ``plan_op``, ``plan_many``, ``evaluate``, ``legal_config``, ``PlanResult``,
  ``Verdict``, ``PlanError``, ``SPILL_LIMIT_BYTES``;
* ``fp4moe.plan.space``: ``KERNELS``, ``get_kernel``, ``register``, ``KernelSpec``, ``LinearProblem``,
  ``QuantizeProblem``, ``DequantizeProblem``, ``WeightDequantizeProblem``, ``MoEGemmProblem``,
  ``MmaExpectation``, ``TimeEstimate``, ``default_gpu``; one module per kernel family
  (``space.linear``, ``space.packed_linear``, ``space.quantize``, ``space.moe``, ``space.packed_moe``);
* ``fp4moe.plan.cli``: the ``fp4moe plan`` command;
* ``fp4moe.plan.crosscompile``: ``CompiledKernel``, ``cross_compile`` (of a
  ``fp4moe.target.compile_request.CompileRequest``);
* ``fp4moe.plan.cache``: ``CompileCache``, ``default_cache_dir``, ``kernel_source_hash``.
"""
