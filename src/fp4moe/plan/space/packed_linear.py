"""``fp4_linear_mma`` (W4A16 decode on the mma.sync kernel) and ``fp4_linear_wgmma`` (the SM90
prefill kernel), both on weights in MMA operand order."""

from __future__ import annotations

from typing import Any

from ...target import GPU, Arch, default_gpu
from ...formats import get_format
from ...target.compile_request import CompileRequest
from .base import SECOND_KERNEL_US, KernelSpec, TimeEstimate, _bandwidth, _cdiv, _mma_rate, _roofline
from .linear import LinearProblem
from .packed import _MmaSpec, _WgmmaSpec

class MmaLinearSpec(_MmaSpec, KernelSpec[LinearProblem, Any]):
    """``kernels.linear_mma.fp4_linear_mma_kernel`` (Gluon, mma.sync): W4A16 decode (M <= 16, bf16
    activations) on weights in MMA operand order, on every architecture from SM80 (what
    ``fp4_linear`` runs there). Shared memory: a few KB for adding the in-program K split's
    (``MMAConfig.kw``) partial tiles, and x's ring where the heuristic takes it (``MMAConfig.xs``,
    up to 64 KB, so the heuristic counts it against the chip); what else can go wrong on a new chip
    is registers (spills) and the MMA instruction, which the compile check proves."""

    name = "fp4_linear_mma"
    problem_type = LinearProblem

    def _check_problem_size(self, problem: LinearProblem) -> None:
        from ...ops.mma_sync import MAX_M

        if problem.M > MAX_M:
            raise ValueError(f"{self.name}: runs decode, M <= {MAX_M}, got M = {problem.M}")

    def candidates(self, problem: LinearProblem, arch: Arch, sm_count: int | None = None) -> list:
        """What the runtime's decode heuristic chooses from: K split over 2, 4 or 8 warp groups of
        one program, one or two 16-row blocks per warp, 128 or 256 K per step (PDL as the heuristic
        launches it; 8-token NVFP4 programs with PDL = 3 also with x read per chunk, ``MMAConfig.xc``),
        and the heuristic's own choice; for K too short to split over warps, the heuristic's one
        program per tile."""
        from ...formats import NVFP4, get_format
        from ...ops.mma_sync import MMAConfig, coresident_rule

        chosen = self.heuristic(problem, arch, sm_count)
        if chosen.kw == 1:
            return [chosen]
        mx = get_format(problem.fmt) is not NVFP4
        xcs = (False, True) if coresident_rule(mx, chosen.block_m, chosen.pdl == 3) else (False,)
        family = [MMAConfig(rb=rb, warps=1, kh=kh, block_m=chosen.block_m, kw=kw, pdl=chosen.pdl, xc=xc)
                  for rb in (1, 2) for kh in (2, 4) for kw in (2, 4, 8) for xc in xcs]
        return family + [chosen] * (chosen not in family)  # with its x ring, where it takes one

    def heuristic(self, problem: LinearProblem, arch: Arch, sm_count: int | None = None):
        from ...ops.mma_sync import choose_mma_config

        self.check_problem(problem)
        self._check_mode(problem, arch)
        gpu = default_gpu(arch)
        return choose_mma_config(problem.M, problem.N, problem.K, sm_count or gpu.sm_count, fmt=problem.fmt,
                                 arch=arch, l2_bytes=int(gpu.l2_mib * 2**20))

    def compile_request(self, config, problem: LinearProblem, arch: Arch) -> CompileRequest:
        from ...ops.mma_requests import mma_compile_request

        self._check_mode(problem, arch)
        return mma_compile_request(config, problem.fmt, arch.sm_version, problem.K, has_bias=problem.has_bias,
                                   out_dtype=self._out_dtype(problem))

    def model_time(self, config, problem: LinearProblem, gpu: GPU, *, registers: int | None = None) -> TimeEstimate:
        from ...target.roofline import fp4_weight_bytes
        from ...ops.mma_pack import KCHUNK
        from ...ops.mma_sync import _split

        M, N, K = problem.M, problem.N, problem.K
        _, split, _ = _split(config, _cdiv(K, KCHUNK))
        if config.kw > 1:  # the K split runs inside the program: one launch, no partial sums
            split = 1
        tiles_n, tiles_m = _cdiv(N, config.block_n), _cdiv(M, config.block_m)
        programs = tiles_n * tiles_m * split
        w_once = fp4_weight_bytes(N, K, problem.fmt)
        x_once, y_once = M * K * 2, M * N * 2
        out_bytes = split * M * N * 4 if split > 1 else y_once
        nbytes = w_once + x_once + out_bytes
        flops = 2 * (tiles_m * config.block_m) * (tiles_n * config.block_n) * K
        peak = gpu.bf16_dense_tflops
        ctas = gpu.arch.ctas_per_sm(32 * config.warps * config.kw, registers=registers,
                                    smem_bytes=self.smem_model(config, problem, gpu.arch).total)
        notes = []
        extra = 0.0
        if split > 1:
            extra = (split * M * N * 4 + y_once) / _bandwidth(gpu) + SECOND_KERNEL_US
            notes.append(f"split-K {split}: fp32 partials and a reduction kernel")
        us, limiter, waves = _roofline(gpu, nbytes=nbytes, flops=flops, peak_tflops=peak, programs=programs,
                                       ctas_per_sm=ctas, l2_bytes=tiles_n * x_once, extra_us=extra)
        bound = max((w_once + x_once + y_once) / _bandwidth(gpu), 2 * M * N * K / _mma_rate(peak))
        return TimeEstimate(us=us, bound_us=bound, limiter=limiter, programs=programs, waves=waves, ctas_per_sm=ctas,
                            bytes=nbytes, flops=flops, peak_tflops=peak, notes=tuple(notes))


class WgmmaLinearSpec(_WgmmaSpec, KernelSpec[LinearProblem, Any]):
    """``kernels.gemm_wgmma.fp4_gemm_wgmma_kernel`` as the plain linear (W4A16, bf16 activations,
    SM90 only): weights decoded into wgmma's register operand, activations by TMA after one pass
    into MMA K order (``ops.mma_layout``). Its shared memory is exact (``wgmma_smem_terms``), and
    the compile check also proves the SASS leaves the registers of in-flight wgmmas alone."""

    name = "fp4_linear_wgmma"
    problem_type = LinearProblem

    def candidates(self, problem: LinearProblem, arch: Arch) -> list:
        """64- and 128-row activation tiles with one or two warpgroups of two register repeats, and
        64- to 256-row tiles with two warpgroups of one repeat (the 256-row ones persistent where K
        has stages - 2 chunks or more, as the launcher runs them); rings of 3 to 6 stages. Small
        batches (M <= ``LinearTuning.wgmma_split_max_m``): also the one 16- to 64-row tile that holds
        every row (several shorter ones gain nothing: docs/performance-engineering.md,
        ``wgmma_split_max_m``), K split 1 to 8 ways."""
        from ...ops.wgmma import WgmmaConfig, persistent_where_possible
        from ...tuning import current_tuning

        self.check_problem(problem)
        self._check_arch(arch)
        self._check_mode(problem, arch)
        small = []
        if problem.M <= current_tuning().linear.wgmma_split_max_m:
            m = min(64, max(16, 1 << (problem.M - 1).bit_length()))
            small = [WgmmaConfig(block_m=m, stages=s, warps=w, split_k=k) for w in (4, 8) for s in (4, 6)
                     for k in (1, 2, 3, 4, 6, 8)]
        return small + [WgmmaConfig(block_m=m, stages=s, warps=w) for m in (64, 128) for w in (4, 8)
                        for s in (3, 4, 5, 6)] \
            + [persistent_where_possible(WgmmaConfig(block_m=m, stages=s, warps=8, repeats=1), problem.K)
               for m in (64, 128, 256) for s in (3, 4, 5, 6)]

    def heuristic(self, problem: LinearProblem, arch: Arch, sm_count: int | None = None):
        from ...ops.wgmma import choose_wgmma_config

        self.check_problem(problem)
        self._check_arch(arch)
        self._check_mode(problem, arch)
        return choose_wgmma_config(problem.M, problem.N, problem.K, sm_count or 132)

    def compile_request(self, config, problem: LinearProblem, arch: Arch) -> CompileRequest:
        from ...ops.mma_requests import wgmma_compile_request

        self._check_mode(problem, arch)
        return wgmma_compile_request(config, problem.fmt, arch.sm_version, has_bias=problem.has_bias,
                                     wg_mode=1 if get_format(problem.fmt).has_global_scale else 0,
                                     out_dtype=self._out_dtype(problem))

    def model_time(self, config, problem: LinearProblem, gpu: GPU, *, registers: int | None = None) -> TimeEstimate:
        from ...target.roofline import fp4_weight_bytes

        from ...ops.mma_pack import KCHUNK
        from ...ops.wgmma import wgmma_split

        M, N, K = problem.M, problem.N, problem.K
        bn, bm = config.block_n, config.block_m
        tiles_m, tiles_n = _cdiv(M, bm), _cdiv(N, bn)
        split = wgmma_split(config, _cdiv(K, KCHUNK))[0]
        w_once = fp4_weight_bytes(N, K, problem.fmt)
        x_once, y_once = M * K * 2, M * N * 2
        # the pass into MMA K order reads x and writes its copy; the GEMM reads the copy
        nbytes = w_once + 3 * x_once + y_once
        l2_bytes = tiles_m * w_once + tiles_n * x_once + y_once
        flops = 2 * (tiles_m * bm) * (tiles_n * bn) * K
        peak = gpu.bf16_dense_tflops
        smem = self.smem_model(config, problem, gpu.arch).total
        ctas = gpu.arch.ctas_per_sm(32 * config.warps, registers=registers, smem_bytes=smem)
        notes = ["activations re-ordered into MMA K order by a separate pass"]
        if config.persistent:  # the same tiles per SM; the per-tile start-up is not modelled either way
            notes.append("persistent: one program per SM over its tiles")
        extra = SECOND_KERNEL_US
        if split > 1:
            extra += (2 * split * M * N * 4 + y_once) / _bandwidth(gpu) + SECOND_KERNEL_US
            notes.append(f"split-K {split}: fp32 partials and a reduction kernel")
        programs = tiles_m * tiles_n * split
        us, limiter, waves = _roofline(gpu, nbytes=nbytes, flops=flops, peak_tflops=peak, programs=programs,
                                       ctas_per_sm=ctas, l2_bytes=l2_bytes, extra_us=extra)
        bound = max((w_once + x_once + y_once) / _bandwidth(gpu), 2 * M * N * K / _mma_rate(peak))
        return TimeEstimate(us=us, bound_us=bound, limiter=limiter, programs=programs, waves=waves,
                            ctas_per_sm=ctas, bytes=nbytes, flops=flops, peak_tflops=peak, notes=tuple(notes))
