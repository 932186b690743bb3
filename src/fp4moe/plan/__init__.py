"""Planning before running: configuration spaces, the shared-memory model, cross-compilation for
any target, and roofline ranking (issue 4).

Public API (import from the submodules; importing ``fp4moe.plan`` itself loads nothing heavy):

* ``fp4moe.plan.planner``: ``plan_op``, ``plan_many``, ``evaluate``, ``legal_config``, ``PlanResult``,
  ``Verdict``, ``PlanError``, ``SPILL_LIMIT_BYTES``;
* ``fp4moe.plan.space``: ``KERNELS``, ``get_kernel``, ``register``, ``KernelSpec``, ``LinearProblem``,
  ``QuantizeProblem``, ``MoEGemmProblem``, ``MmaExpectation``, ``TimeEstimate``, ``default_gpu``;
  registered kernels: ``fp4_linear``, ``nvfp4_quantize``, ``fp4_moe_gemm``;
* ``fp4moe.plan.smem``: ``SmemBreakdown``, ``SmemTerm``, ``linear_smem``, ``quantize_smem``, ``moe_smem``
  (the MoE model is a measured table, ``moe_smem_measured.json``, with a safe upper bound elsewhere);
* ``fp4moe.plan.cli``: the ``fp4moe plan`` command;
* ``fp4moe.plan.crosscompile``: ``CompileRequest``, ``CompiledKernel``, ``cross_compile``;
* ``fp4moe.plan.cache``: ``CompileCache``, ``default_cache_dir``, ``kernel_source_hash``.
"""
