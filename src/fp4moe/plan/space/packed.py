"""What the specs of the Gluon kernels on weights in MMA operand order share: the mma.sync kernel
(``kernels.linear_mma``) and the SM90 wgmma kernel (``kernels.gemm_wgmma``), as a plain linear
(``packed_linear``) or as the MoE layer's grouped GEMMs (``packed_moe``)."""

from __future__ import annotations

from typing import Any

from ...target import Arch
from ...target.smem import SmemBreakdown
from .base import MmaExpectation, _cdiv

class _PackedSpec:
    """What the specs of the kernels on weights in MMA operand order (``ops.mma_pack``) share: W4A16
    with bf16 activations, or emulated W4A4 (bf16 or fp16 activations, on GPUs without FP4 MMA:
    ``ops.linear.runs_packed``), which runs the same kernels on its activations dequantized to bf16
    and keeps x's dtype for what the kernel writes (``_out_dtype``); ``check_problem`` for the
    problems the runtime sends them."""

    name: str

    def check_problem(self, problem: Any) -> Any:
        problem = super().check_problem(problem)  # type: ignore[misc]
        if problem.mode == "w4a16" and problem.x_dtype != "bf16":
            raise ValueError(f"{self.name}: runs W4A16 with bf16 activations, got {problem.x_dtype}")
        self._check_problem_size(problem)
        return problem

    def _check_mode(self, problem: Any, arch: Arch) -> None:
        """W4A4 runs here only where it is emulated (no FP4 MMA); elsewhere on native FP4 MMA."""
        from ...ops.linear import runs_packed

        if problem.mode == "w4a4" and not runs_packed("w4a4", arch):
            raise ValueError(f"{self.name}: {arch.name} has native FP4 MMA ({arch.fp4_mma}); its W4A4 runs the "
                             "Triton kernels (fp4_linear, fp4_moe_gemm)")

    @staticmethod
    def _out_dtype(problem: Any) -> str:
        """What the kernel writes: bf16 for W4A16; x's dtype for emulated W4A4."""
        return "bf16" if problem.mode == "w4a16" else problem.x_dtype

    def _check_problem_size(self, problem: Any) -> None:
        pass


class _MmaSpec(_PackedSpec):
    """The mma.sync kernel (``kernels.linear_mma``): ``MMAConfig``, bf16 mma.sync, shared memory only
    for the in-program K split's partial tiles and, with ``xs``, x's ring."""

    @property
    def config_type(self) -> type:
        from ...ops.mma_sync import MMAConfig

        return MMAConfig

    def variant(self, problem: Any, arch: Arch) -> str:
        return "w4a16_mma" if problem.mode == "w4a16" else "w4a4_emulated_mma"

    def smem_model(self, config, problem: Any, arch: Arch) -> SmemBreakdown:
        from ...ops.mma_pack import KCHUNK
        from ...ops.mma_sync import _fit_kw, _split
        from ...target.smem import SmemTerm

        self.check_config(config)  # type: ignore[attr-defined]
        chunks = _cdiv(problem.K, KCHUNK)
        kh, kw = _fit_kw(config, chunks) if config.kw > 1 else (_split(config, chunks)[0], 1)
        terms = []
        if config.xs and chunks * KCHUNK == problem.K:  # x's ring (the launcher keeps it off for padded K)
            terms.append(SmemTerm("x ring (cp.async)", kw * config.block_m * kh * KCHUNK * 2, config.xs,
                                  source="allocate_shared_memory"))
        if kw > 1:
            # the kw warp groups' fp32 partial tiles meet in shared memory for their sum (gl.sum, axis 0)
            terms.append(SmemTerm("K-slice partial tiles", config.block_n * config.block_m * 4, kw,
                                  phase="epilogue", source="convert_layout scratch of gl.sum"))
        return SmemBreakdown(tuple(terms))  # without either, operands go from global memory to registers

    def expected_mma(self, problem: Any, arch: Arch) -> MmaExpectation:
        return MmaExpectation("bf16 mma.sync (m16n8k16)", (("mma.sync.aligned.m16n8k16", ".bf16"),))


class _WgmmaSpec(_PackedSpec):
    """The SM90 wgmma kernel (``kernels.gemm_wgmma``): ``WgmmaConfig``, its exact shared memory
    (``wgmma_smem_terms``), bf16 wgmma; other architectures are refused with the reason."""

    @property
    def config_type(self) -> type:
        from ...ops.wgmma import WgmmaConfig

        return WgmmaConfig

    def variant(self, problem: Any, arch: Arch) -> str:
        return "w4a16_wgmma" if problem.mode == "w4a16" else "w4a4_emulated_wgmma"

    def _check_arch(self, arch: Arch) -> None:
        if arch.bf16_mma != "wgmma":
            raise ValueError(f"{self.name}: needs wgmma (SM90); {arch.name} has {arch.bf16_mma} "
                             "(its prefill runs the Triton kernels)")

    def smem_model(self, config, problem: Any, arch: Arch) -> SmemBreakdown:
        from ...ops.wgmma import wgmma_smem_terms
        from ...target.smem import SmemTerm

        self.check_config(config)  # type: ignore[attr-defined]
        return SmemBreakdown(tuple(SmemTerm(name, each, count, source="allocate_shared_memory")
                                   for name, each, count in wgmma_smem_terms(config, problem.fmt)))

    def expected_mma(self, problem: Any, arch: Arch) -> MmaExpectation:
        return MmaExpectation("bf16 wgmma (A from registers)", (("wgmma.mma_async", ".bf16"),))
