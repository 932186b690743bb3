"""``fp4_moe_mma`` and ``fp4_moe_wgmma``: the MoE layer's grouped GEMMs on the mma.sync kernel at
decode and on the SM90 wgmma kernel at prefill (weights in MMA operand order)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ...target import GPU, Arch, default_gpu
from ...formats import get_format
from ...target.compile_request import CompileRequest
from .base import SECOND_KERNEL_US, KernelSpec, TimeEstimate, _bandwidth, _cdiv, _mma_rate, _roofline
from .moe import MoEGemmProblem
from .packed import _MmaSpec, _WgmmaSpec


def _uniform_tiles(problem: Any, block_m: int) -> tuple[int, int]:
    """(active experts, row tiles of ``block_m``) of an MoE problem under uniform routing."""
    experts = problem.active_experts
    return experts, experts * _cdiv(-(-problem.pairs // experts), block_m)


class MmaMoESpec(_MmaSpec, KernelSpec[MoEGemmProblem, Any]):
    """The MoE layer's grouped GEMMs at decode on the mma.sync kernel (``kernels.linear_mma``,
    GROUPED): what the runtime runs for bf16 W4A16 layers with <= 16 rows per expert (<= 8 on SM90
    when the wgmma kernel can take the layer; ``ops.moe.packed_moe_kernel``). Each GEMM writes fp32 partial sums that a Triton epilogue
    kernel finishes. GEMM 1 of SiLU layers on gate-then-up weights runs its epilogue (globals, bias,
    SwiGLU) in the kernel when its grid has enough programs per SM (``ops.moe.fuses_swiglu``), else
    the epilogue kernel writes h; GEMM 2's epilogue is fused with the combine
    (``moe_partials_combine_kernel``: globals, bias, routing weight, the sum over each token's
    slots) and writes the token rows. No shared memory. The chain's kernels launch with PDL on
    SM90+ (``kernels.pdl``), which the time model does not credit."""

    name = "fp4_moe_mma"
    problem_type = MoEGemmProblem

    def _check_problem_size(self, problem: MoEGemmProblem) -> None:
        from ...ops.mma_sync import MAX_M

        if problem.pairs / problem.E > MAX_M:
            raise ValueError(f"{self.name}: runs decode, <= {MAX_M} rows per expert, got {problem.pairs / problem.E:.1f}")

    def candidates(self, problem: MoEGemmProblem, arch: Arch) -> list:
        from ...ops.mma_sync import MMAConfig

        self.check_problem(problem)
        self._check_mode(problem, arch)
        block_ms = (problem.block_m,) if problem.block_m in (8, 16) else (8, 16)
        return [MMAConfig(rb=rb, warps=4, kh=kh, block_m=bm, split_k=1) for bm in block_ms for rb in (1, 2)
                for kh in (1, 2, 4)]

    def heuristic(self, problem: MoEGemmProblem, arch: Arch, sm_count: int | None = None):
        """The runtime's configuration (``ops.moe.mma_moe_layer_config``; GEMM 2's through
        ``mma_moe_gemm2_config``): where it runs two launches (``MMAHeights``), that of the problem's
        class (``rows``), or without one the large tiles' (the dispatch plan's height)."""
        from ...ops.moe import MMAHeights, mma_moe_gemm2_config, mma_moe_layer_config

        self.check_problem(problem)
        self._check_mode(problem, arch)
        cfg = mma_moe_layer_config(problem.T * problem.top_k / problem.E, problem.E)
        rows = None
        if isinstance(cfg, MMAHeights):
            chosen = [(c, rows) for c, rows in cfg.classes() if rows == problem.rows]
            cfg, rows = chosen[0] if chosen else (cfg.large, None)
        if problem.gemm == 2:
            cfg = mma_moe_gemm2_config(cfg, rows)
        if problem.block_m in (8, 16) and cfg.block_m != problem.block_m:
            cfg = dataclasses.replace(cfg, block_m=problem.block_m)
        return cfg

    def compile_request(self, config, problem: MoEGemmProblem, arch: Arch) -> CompileRequest:
        from ...ops.mma_pack import KCHUNK
        from ...ops.mma_requests import mma_compile_request
        from ...ops.moe import mma_pair_rows, overlaps_previous_class
        from ...tuning import current_tuning

        # GEMM 1 with its SiLU epilogue in the kernel (``ops.moe.fuses_swiglu``; gate-then-up weights,
        # one global per expert for NVFP4, none for MXFP4: the presets' checkpoints)
        self._check_mode(problem, arch)
        return mma_compile_request(config, problem.fmt, arch.sm_version, problem.K, grouped=True,
                                   gather=problem.gemm == 1, plan_ready=problem.gemm == 2,
                                   independent=overlaps_previous_class(problem.rows),
                                   swiglu=self._fused(config, problem, default_gpu(arch).sm_count),
                                   wg_mode=1 if problem.fmt == "nvfp4" else 0, out_dtype=self._out_dtype(problem),
                                   order=current_tuning().moe.word_order,
                                   part_dtype=mma_pair_rows(config, -(-problem.K // KCHUNK), problem.x_dtype)
                                   if problem.gemm == 2 else "fp32")

    @staticmethod
    def _fused(config, problem: MoEGemmProblem, sm_count: int) -> bool:
        """As the runtime decides (``ops.moe.fuses_swiglu``) on a GPU of ``sm_count`` SMs. The compile
        request sees only the architecture and takes its catalogue product's SM count, so for another
        product of the architecture near the threshold it may compile the other variant than
        ``model_time`` models (and the registers it reports are that variant's: 121 against 72 on
        SM90)."""
        from ...ops.dispatch import max_tiles
        from ...ops.moe import MMAHeights, fused_programs_per_sm, fuses_swiglu, mma_moe_layer_config

        pairs = problem.T * problem.top_k
        if problem.rows is not None:  # both launches of MMAHeights: as the large class's plan decides
            layer = mma_moe_layer_config(pairs / problem.E, problem.E)
            config = layer.large if isinstance(layer, MMAHeights) else config
        tiles = max_tiles(pairs, problem.E, config.block_m)
        return problem.gemm == 1 and fuses_swiglu(config, "silu", False, problem.N,
                                                  fused_programs_per_sm(tiles, problem.N, config, sm_count))

    def model_time(self, config, problem: MoEGemmProblem, gpu: GPU, *, registers: int | None = None) -> TimeEstimate:
        from ...target.roofline import fp4_weight_bytes

        bm = config.block_m
        experts, tiles = _uniform_tiles(problem, bm)
        w_rows = problem.weight_rows
        fused = self._fused(config, problem, gpu.sm_count)
        # a fused GEMM 1 program runs block_n gate rows and the matching block_n up rows
        tiles_n = _cdiv(problem.N if fused else w_rows, config.block_n)
        programs = tiles * tiles_n
        w_expert = fp4_weight_bytes(w_rows, problem.K, problem.fmt)
        x_rows = problem.pairs * problem.K * 2
        partials = 0 if fused else problem.pairs * w_rows * 4
        # h (GEMM 1), written by the kernel when fused; GEMM 2's epilogue is fused with the combine and
        # writes the tokens' rows
        out_bytes = problem.pairs * problem.N * 2 if problem.gemm == 1 else problem.T * problem.N * 2
        nbytes = experts * w_expert + x_rows + partials + (out_bytes if fused else 0)
        flops = 2 * (tiles * bm) * (tiles_n * config.block_n * (2 if fused else 1)) * problem.K
        peak = gpu.bf16_dense_tflops
        ctas = gpu.arch.ctas_per_sm(32 * config.warps, registers=registers, smem_bytes=0)
        # the epilogue kernel reads the partials and writes h (GEMM 1 unfused) or the tokens' rows
        extra = 0.0 if fused else (partials + out_bytes) / _bandwidth(gpu) + SECOND_KERNEL_US
        us, limiter, waves = _roofline(gpu, nbytes=nbytes, flops=flops, peak_tflops=peak, programs=programs,
                                       ctas_per_sm=ctas, l2_bytes=tiles * w_expert + tiles_n * x_rows,
                                       extra_us=extra)
        bound = max((experts * w_expert + x_rows + out_bytes) / _bandwidth(gpu),
                    2 * problem.pairs * w_rows * problem.K / _mma_rate(peak))
        return TimeEstimate(us=us, bound_us=bound, limiter=limiter, programs=programs, waves=waves, ctas_per_sm=ctas,
                            bytes=nbytes, flops=flops, peak_tflops=peak,
                            notes=("SwiGLU epilogue in the kernel",) if fused else
                            ("fp32 partial sums and an epilogue kernel",))


class WgmmaMoESpec(_WgmmaSpec, KernelSpec[MoEGemmProblem, Any]):
    """The MoE layer's grouped GEMMs on the SM90 wgmma kernel (``kernels.gemm_wgmma``, GROUPED):
    what the runtime runs for bf16 W4A16 layers with more than 8 rows per expert on SM90
    (``ops.moe.packed_layout_config``). GEMM 1 reads the gathered rows in MMA K order and applies
    SwiGLU; GEMM 2 applies the routing weight and scatters bf16 pair rows. Same shared memory as the
    plain kernel (``wgmma_smem_terms``)."""

    name = "fp4_moe_wgmma"
    problem_type = MoEGemmProblem

    def _check_problem_size(self, problem: MoEGemmProblem) -> None:
        if problem.gemm == 1 and problem.N % 16:
            raise ValueError(f"{self.name}: GEMM 1 fuses SwiGLU for I a multiple of 16, got I = {problem.N}")

    def _block_ms(self, problem: MoEGemmProblem) -> tuple[int, ...]:
        if problem.block_m is not None:
            if problem.block_m not in (16, 32, 64, 128):
                raise ValueError(f"{self.name}: block_m {problem.block_m} is pinned; the kernel takes 16, 32, 64 "
                                 "or 128")
            return (problem.block_m,)
        return (32, 64, 128)

    def candidates(self, problem: MoEGemmProblem, arch: Arch) -> list:
        from ...ops.wgmma import WgmmaConfig

        self.check_problem(problem)
        self._check_arch(arch)
        self._check_mode(problem, arch)
        return [WgmmaConfig(block_m=m, stages=s, warps=w) for m in self._block_ms(problem) for w in (4, 8)
                for s in (3, 4, 5, 6)]

    def heuristic(self, problem: MoEGemmProblem, arch: Arch, sm_count: int | None = None):
        from ...ops.moe import wgmma_gemm2_config, wgmma_moe_config

        self.check_problem(problem)
        self._check_arch(arch)
        self._check_mode(problem, arch)
        cfg = wgmma_moe_config(problem.pairs / problem.E)
        if problem.gemm == 2:
            cfg = wgmma_gemm2_config(cfg)
        if problem.block_m is not None and cfg.block_m != problem.block_m:
            bm = self._block_ms(problem)[0]
            cfg = cfg.with_tail(cfg.tail_m if cfg.tail_m < bm else 0, block_m=bm)
        return cfg

    def compile_request(self, config, problem: MoEGemmProblem, arch: Arch) -> CompileRequest:
        from ...ops.mma_requests import wgmma_compile_request
        from ...tuning import current_tuning

        self._check_mode(problem, arch)
        # emulated W4A4 (``ops.moe_packed._run_wgmma`` with its re-quantization): GEMM 1 writes h in K order
        # and in x's dtype; the dequantize kernel then puts it into GEMM 2's MMA K order
        gemm1 = problem.gemm == 1
        return wgmma_compile_request(config, problem.fmt, arch.sm_version, gemm=f"gemm{problem.gemm}",
                                     wg_mode=1 if get_format(problem.fmt).has_global_scale else 0,
                                     out_dtype=self._out_dtype(problem) if gemm1 else "bf16",
                                     out_mma_order=gemm1 and problem.mode == "w4a16",
                                     order=current_tuning().moe.word_order)

    def model_time(self, config, problem: MoEGemmProblem, gpu: GPU, *, registers: int | None = None) -> TimeEstimate:
        from ...target.roofline import fp4_weight_bytes

        bm, rows = config.block_m, config.block_n  # weight rows per program
        experts, tiles = _uniform_tiles(problem, bm)
        w_rows = problem.weight_rows
        tiles_n = _cdiv(w_rows, rows)
        programs = tiles * tiles_n
        w_expert = fp4_weight_bytes(w_rows, problem.K, problem.fmt)
        x_rows = problem.pairs * problem.K * 2
        out_bytes = problem.pairs * problem.N * 2  # bf16 h (GEMM 1) or pair rows (GEMM 2, ops.moe.PAIR_ROWS_DTYPE)
        gather = 2 * x_rows if problem.gemm == 1 else 0  # the pass into MMA K order (GEMM 1 only)
        nbytes = experts * w_expert + x_rows + out_bytes + gather
        l2_bytes = tiles * w_expert + tiles_n * x_rows + out_bytes
        flops = 2 * (tiles * bm) * (tiles_n * rows) * problem.K
        peak = gpu.bf16_dense_tflops
        smem = self.smem_model(config, problem, gpu.arch).total
        ctas = gpu.arch.ctas_per_sm(32 * config.warps, registers=registers, smem_bytes=smem)
        us, limiter, waves = _roofline(gpu, nbytes=nbytes, flops=flops, peak_tflops=peak, programs=programs,
                                       ctas_per_sm=ctas, l2_bytes=l2_bytes,
                                       extra_us=SECOND_KERNEL_US if problem.gemm == 1 else 0.0)
        bound = max((experts * w_expert + x_rows + out_bytes) / _bandwidth(gpu),
                    2 * problem.pairs * w_rows * problem.K / _mma_rate(peak))
        notes = (f"{tiles} row tiles of {bm} over {experts} experts (uniform routing)",)
        return TimeEstimate(us=us, bound_us=bound, limiter=limiter, programs=programs, waves=waves, ctas_per_sm=ctas,
                            bytes=nbytes, flops=flops, peak_tflops=peak, notes=notes)
