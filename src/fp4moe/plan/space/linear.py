"""``fp4_linear``: ``LinearProblem`` and the Triton kernel's spec (paths w4a16, w4a4_emulated,
w4a4_native)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ...target import GPU, Arch
from ...formats import get_format
from ...target.compile_request import CompileRequest
from ...target.smem import SmemBreakdown, linear_family, linear_smem
from .base import (_PATHS, _X_DTYPES, SECOND_KERNEL_US, KernelSpec, MmaExpectation, Path, TimeEstimate, _bandwidth,
                   _cdiv, _mma_rate, _pow2_at_least, _roofline)

@dataclass(frozen=True)
class LinearProblem:
    """``y[M, N] = x[M, K] @ W[N, K]^T`` with W in an FP4 format.

    mode "w4a16": x bf16/fp16; "w4a4": x quantized to NVFP4 (NVFP4 weights only). ``path`` pins
    the kernel path; None takes the architecture's (``ops.linear.target_path``).
    """

    M: int
    N: int
    K: int
    fmt: str = "nvfp4"
    mode: Literal["w4a16", "w4a4"] = "w4a16"
    x_dtype: Literal["bf16", "fp16"] = "bf16"
    has_bias: bool = False
    path: Path | None = None

    def __post_init__(self) -> None:
        for name in ("M", "N", "K"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"LinearProblem.{name}: expected a positive int, got {v!r}")
        fmt = get_format(self.fmt)  # raises on unknown names
        if self.K % fmt.block_size:
            raise ValueError(f"LinearProblem.K: expected a multiple of the {fmt} block size {fmt.block_size}, "
                             f"got {self.K}")
        if self.mode not in ("w4a16", "w4a4"):
            raise ValueError(f"LinearProblem.mode: expected 'w4a16' or 'w4a4', got {self.mode!r}")
        if self.mode == "w4a4" and fmt.name != "nvfp4":
            raise ValueError(f"LinearProblem: mode 'w4a4' needs NVFP4 weights, got {fmt}")
        if self.x_dtype not in _X_DTYPES:
            raise ValueError(f"LinearProblem.x_dtype: expected one of {_X_DTYPES}, got {self.x_dtype!r}")
        if self.path is not None:
            if self.path not in _PATHS:
                raise ValueError(f"LinearProblem.path: expected one of {_PATHS} or None, got {self.path!r}")
            if (self.path == "w4a16") != (self.mode == "w4a16"):
                raise ValueError(f"LinearProblem.path: {self.path!r} does not compute mode {self.mode!r}")

    def path_on(self, arch: Arch) -> Path:
        if self.path is not None:
            return self.path
        from ...ops.linear import target_path

        return target_path(self.mode, arch)

    def __str__(self) -> str:
        return f"M={self.M} N={self.N} K={self.K} {self.fmt} {self.mode}"


class LinearSpec(KernelSpec[LinearProblem, Any]):
    """``kernels.linear.fp4_linear_kernel`` (with ``splitk_reduce_kernel`` when K is split)."""

    name = "fp4_linear"
    problem_type = LinearProblem

    @property
    def config_type(self) -> type:  # type: ignore[override]
        from ...ops.linear import LinearConfig

        return LinearConfig

    def variant(self, problem: LinearProblem, arch: Arch) -> str:
        return problem.path_on(arch)

    # -- space

    def candidates(self, problem: LinearProblem, arch: Arch) -> list:
        """Tiles the kernel supports and that can pay off on this problem.

        block_n 64/128 (128 only for tcgen05 FP4, whose MMA is 128 rows tall); block_m from 16 up
        to the next power of two of M (256 at most); block_k 64..256, not beyond K; 4 warps, and 8
        for tiles of 8,192 accumulators or more; num_stages 1..4 for decode tiles (block_m <= 64),
        2..4 above (a prefill tile without a pipeline is never competitive); split-K for decode
        (M <= 256) in powers of two while every split keeps two or more K steps.
        """
        from ...ops.linear import LinearConfig

        self.check_problem(problem)
        path = problem.path_on(arch)
        family = linear_family(path, arch)
        block_ns = (128,) if family == "tcgen05_fp4" else (64, 128)
        m_cap = min(256, max(16, _pow2_at_least(problem.M)))
        block_ms = [m for m in (16, 32, 64, 128, 256) if m <= m_cap]
        k_cap = max(64, _pow2_at_least(problem.K))
        block_ks = [k for k in (64, 128, 256) if k <= k_cap]
        out = []
        for n in block_ns:
            for m in block_ms:
                warps = (4,) if n * m < 8192 else (4, 8)
                stages = (1, 2, 3, 4) if m <= 64 else (2, 3, 4)
                for k in block_ks:
                    splits = [1]
                    if problem.M <= 256:
                        while problem.K // (k * splits[-1] * 2) >= 2 and splits[-1] < 16:
                            splits.append(splits[-1] * 2)
                    for w in warps:
                        for s in stages:
                            for sk in splits:
                                out.append(LinearConfig(block_n=n, block_m=m, block_k=k, num_warps=w, num_stages=s,
                                                        split_k=sk))
        return out

    def heuristic(self, problem: LinearProblem, arch: Arch, sm_count: int | None = None):
        from ...ops.linear import choose_config

        self.check_problem(problem)
        return choose_config(problem.M, problem.N, problem.K, path=problem.path_on(arch), arch=arch,
                             sm_count=sm_count)

    # -- models

    def smem_model(self, config, problem: LinearProblem, arch: Arch) -> SmemBreakdown:
        self.check_config(config)
        return linear_smem(config.block_n, config.block_m, config.block_k, config.num_warps, config.num_stages,
                           config.split_k, path=problem.path_on(arch), arch=arch,
                           group=get_format(problem.fmt).block_size, x_dtype=problem.x_dtype)

    def compile_request(self, config, problem: LinearProblem, arch: Arch) -> CompileRequest:
        import torch

        from ...ops.linear import compile_request

        x_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[problem.x_dtype]
        return compile_request(config, problem.path_on(arch), problem.fmt, arch.sm_version, x_dtype=x_dtype,
                               has_bias=problem.has_bias)

    def expected_mma(self, problem: LinearProblem, arch: Arch) -> MmaExpectation:
        """W4A4 on SM100/SM120 must use the native block-scaled FP4 MMA (never decoded to bf16);
        everything else a bf16/fp16 tensor-core MMA of the architecture's widest kind."""
        if problem.mode == "w4a4" and arch.fp4_mma == "tcgen05":
            return MmaExpectation(f"block-scaled FP4 tcgen05.mma (kind::mxf4nvf4), {arch.name}'s native FP4 MMA",
                                  (("tcgen05.mma", "kind::mxf4nvf4", "block_scale"),))
        if problem.mode == "w4a4" and arch.fp4_mma == "mma_sync_block_scaled":
            return MmaExpectation(f"block-scaled FP4 mma.sync (m16n8k64, kind::mxf4nvf4), {arch.name}'s native FP4 MMA",
                                  (("mma.sync.aligned.m16n8k64", "kind::mxf4nvf4", "block_scale"),))
        dt = ".f16" if problem.mode == "w4a16" and problem.x_dtype == "fp16" else ".bf16"
        name = "fp16" if dt == ".f16" else "bf16"
        if arch.bf16_mma == "tcgen05":
            return MmaExpectation(f"{name} tcgen05.mma (kind::f16)", (("tcgen05.mma", "kind::f16"),))
        if arch.bf16_mma == "wgmma":
            return MmaExpectation(f"{name} wgmma (or mma.sync)", (("wgmma.mma_async", dt), ("mma.sync", dt)))
        return MmaExpectation(f"{name} mma.sync (m16n8k16)", (("mma.sync.aligned.m16n8k16", dt),))

    def model_time(self, config, problem: LinearProblem, gpu: GPU, *, registers: int | None = None) -> TimeEstimate:
        from ...target.roofline import fp4_weight_bytes

        arch = gpu.arch
        M, N, K = problem.M, problem.N, problem.K
        path = problem.path_on(arch)
        bn, bm, bk = config.block_n, config.block_m, config.block_k
        # the launcher's split: never more splits than K steps, each split a whole number of steps
        split = min(config.split_k, _cdiv(K, bk))
        split = _cdiv(K, _cdiv(_cdiv(K, split), bk) * bk)
        tiles_m = _cdiv(M, bm)
        programs = _cdiv(N, bn) * tiles_m * split
        notes = []
        tiles_n = _cdiv(N, bn)
        w_once = fp4_weight_bytes(N, K, problem.fmt)
        w_bytes = w_once
        if tiles_m > 1 and w_bytes > gpu.l2_mib * 2**20 / 2:
            w_bytes *= tiles_m  # each M tile streams W again once it no longer fits in L2
            notes.append(f"W re-read from DRAM by {tiles_m} M tiles (larger than half the L2)")
        # what the GEMM reads of x: bf16 (W4A16) or NVFP4 codes + E4M3 scales (W4A4)
        x_once = M * K * 2 if path == "w4a16" else M * K // 2 + M * K // 16
        y_once = M * N * 2
        out_bytes = M * N * 4 * split if split > 1 else y_once
        nbytes = w_bytes + x_once + out_bytes
        l2_bytes = tiles_m * w_once + tiles_n * x_once + out_bytes
        flops = 2 * (tiles_m * bm) * (tiles_n * bn) * K
        native = path == "w4a4_native"
        peak = gpu.fp4_dense_tflops if native else gpu.bf16_dense_tflops
        if peak is None:
            raise ValueError(f"model_time: {gpu.name} has no FP4 peak in the catalogue; it cannot run {path}")
        smem = self.smem_model(config, problem, arch).total
        ctas = arch.ctas_per_sm(32 * config.num_warps, registers=registers, smem_bytes=smem)
        extra = 0.0
        if split > 1:  # the reduction kernel reads the partials and writes y
            extra = (split * M * N * 4 + M * N * 2) / _bandwidth(gpu) + SECOND_KERNEL_US
            notes.append(f"split-K {split}: fp32 partials and a reduction kernel")
        us, limiter, waves = _roofline(gpu, nbytes=nbytes, flops=flops, peak_tflops=peak, programs=programs,
                                       ctas_per_sm=ctas, l2_bytes=l2_bytes, extra_us=extra)
        # the problem's own roofline: W, x and y once, unpadded FLOPs, the path's peak
        bound = max((w_once + x_once + y_once) / _bandwidth(gpu), 2 * M * N * K / _mma_rate(peak))
        return TimeEstimate(us=us, bound_us=bound, limiter=limiter, programs=programs, waves=waves, ctas_per_sm=ctas,
                            bytes=nbytes, flops=flops, peak_tflops=peak, notes=tuple(notes))
