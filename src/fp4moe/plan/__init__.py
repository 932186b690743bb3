"""Planning before running: configuration spaces, the shared-memory model, cross-compilation for
any target, and roofline ranking (issue 4).

Public API (import from the submodules; importing ``fp4moe.plan`` itself loads nothing heavy):

* ``fp4moe.plan.planner``: ``plan_op``, ``plan_many``, ``evaluate``, ``legal_config``, ``PlanResult``,
  ``Verdict``, ``PlanError``, ``SPILL_LIMIT_BYTES``;
* ``fp4moe.plan.space``: ``KERNELS``, ``get_kernel``, ``register``, ``KernelSpec``, ``LinearProblem``,
  ``QuantizeProblem``, ``MmaExpectation``, ``TimeEstimate``, ``default_gpu``;
* ``fp4moe.plan.smem``: ``SmemBreakdown``, ``SmemTerm``, ``linear_smem``, ``quantize_smem``;
* ``fp4moe.plan.crosscompile``: ``CompileRequest``, ``CompiledKernel``, ``cross_compile``;
* ``fp4moe.plan.cache``: ``CompileCache``, ``default_cache_dir``, ``kernel_source_hash``.
"""
