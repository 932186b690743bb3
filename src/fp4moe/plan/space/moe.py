"""``fp4_moe_gemm``: ``MoEGemmProblem`` (one grouped GEMM of an MoE layer) and the Triton kernel's
spec (``kernels.moe.moe_gemm_kernel``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from ...target import GPU, Arch
from ...formats import get_format
from ...target.compile_request import CompileRequest
from ...target.smem import SmemBreakdown, moe_smem
from .base import (_X_DTYPES, KernelSpec, MmaExpectation, TimeEstimate, _bandwidth, _cdiv, _mma_rate, _pow2_at_least,
                   _roofline, get_kernel)
from .linear import LinearProblem

@dataclass(frozen=True)
class MoEGemmProblem:
    """One grouped GEMM of an MoE layer (``kernels.moe.moe_gemm_kernel``) on one GPU.

    ``T`` tokens, each routed to ``top_k`` of the ``E`` experts held here (uniform routing is
    assumed by the time model). ``gemm`` 1: gate+up with SwiGLU, ``N`` = I (output columns; the
    weight tile holds 2 x BLOCK_N rows, gate and up), ``K`` = H, tokens gathered; ``gemm`` 2:
    down, ``N`` = H, ``K`` = I, rows scattered to pair outputs with the routing weight (the mma.sync
    decode path adds them per token in the same kernel as GEMM 2's epilogue).
    mode "w4a16": x bf16/fp16; "w4a4": x quantized to NVFP4 (NVFP4 weights only).
    ``block_m``: the dispatch plan's tile height when it is fixed (both GEMMs of a layer run on
    one plan, so they must share block_m; 8 only for the mma.sync kernel); None lets the planner
    choose it. ``rows`` = (lo, hi): one launch of a decode GEMM that runs as two
    (``ops.moe.MMAHeights``), over the experts with lo < rows <= hi only; ``pairs`` and
    ``active_experts`` are then that class's expected share under uniform routing (each expert
    takes a token with probability top_k / E, so its rows are binomial).
    """

    T: int
    top_k: int
    E: int
    N: int
    K: int
    gemm: Literal[1, 2] = 1
    fmt: str = "nvfp4"
    mode: Literal["w4a16", "w4a4"] = "w4a16"
    x_dtype: Literal["bf16", "fp16"] = "bf16"
    block_m: int | None = None
    rows: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        from ...ops.dispatch import check_rows

        object.__setattr__(self, "rows", check_rows(self.rows))
        for name in ("T", "top_k", "E", "N", "K"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MoEGemmProblem.{name}: expected a positive int, got {v!r}")
        if self.gemm not in (1, 2):
            raise ValueError(f"MoEGemmProblem.gemm: expected 1 (gate+up) or 2 (down), got {self.gemm!r}")
        fmt = get_format(self.fmt)
        if self.K % fmt.block_size:
            raise ValueError(f"MoEGemmProblem.K: expected a multiple of the {fmt} block size {fmt.block_size}, "
                             f"got {self.K}")
        if self.mode not in ("w4a16", "w4a4"):
            raise ValueError(f"MoEGemmProblem.mode: expected 'w4a16' or 'w4a4', got {self.mode!r}")
        if self.mode == "w4a4" and fmt.name != "nvfp4":
            raise ValueError(f"MoEGemmProblem: mode 'w4a4' needs NVFP4 weights, got {fmt}")
        if self.x_dtype not in _X_DTYPES:
            raise ValueError(f"MoEGemmProblem.x_dtype: expected one of {_X_DTYPES}, got {self.x_dtype!r}")
        if self.block_m is not None and (not isinstance(self.block_m, int) or self.block_m < 8
                                         or self.block_m & (self.block_m - 1)):
            raise ValueError(f"MoEGemmProblem.block_m: expected None or a power of two >= 8, got {self.block_m!r}")

    @property
    def pairs(self) -> int:
        """Token-expert pairs (rows of the grouped GEMM; of a class: its expected rows, at least 1)."""
        if self.rows is None:
            return self.T * self.top_k
        return max(1, round(self.E * self._class_share()[1]))

    @property
    def active_experts(self) -> int:
        """Experts that receive at least one row: ``min(E, T * top_k)`` (uniform routing; of a class:
        its expected experts, at least 1)."""
        if self.rows is None:
            return min(self.E, self.pairs)
        return max(1, round(self.E * self._class_share()[0]))

    def _class_share(self) -> tuple[float, float]:
        """(P(lo < c <= hi), E[c; lo < c <= hi]) for one expert's rows c ~ Binomial(T, top_k / E)."""
        lo, hi = self.rows
        p = min(1.0, self.top_k / self.E)
        prob = mean = 0.0
        for c in range(lo + 1, min(hi, self.T) + 1):
            if p == 1.0:
                pc = float(c == self.T)
            else:
                pc = math.exp(math.lgamma(self.T + 1) - math.lgamma(c + 1) - math.lgamma(self.T - c + 1)
                              + c * math.log(p) + (self.T - c) * math.log1p(-p))
            prob += pc
            mean += c * pc
        return prob, mean

    @property
    def weight_rows(self) -> int:
        """Rows of one expert's weight: 2 N (gate and up) for GEMM 1, N for GEMM 2."""
        return 2 * self.N if self.gemm == 1 else self.N

    def hidden_and_intermediate(self) -> tuple[int, int]:
        """(H, I) of the layer, as ``ops.moe.choose_moe_configs`` takes them."""
        return (self.K, self.N) if self.gemm == 1 else (self.N, self.K)

    def act_on(self, arch: Arch) -> int:
        """The kernel's ACT: 0 W4A16; 1 W4A4 decoded in the kernel; 2 W4A4 on native FP4 MMA."""
        if self.mode == "w4a16":
            return 0
        return 2 if arch.fp4_mma != "none" else 1

    def __str__(self) -> str:
        what = "gate+up" if self.gemm == 1 else "down"
        pinned = f" block_m={self.block_m}" if self.block_m is not None else ""
        if self.rows is not None:
            pinned += f" experts of {self.rows[0]} < rows <= {self.rows[1]}"
        return (f"GEMM {self.gemm} ({what}) T={self.T} top_k={self.top_k} E={self.E} N={self.N} K={self.K} "
                f"{self.fmt} {self.mode}{pinned}")


_MOE_VARIANTS = {0: "w4a16", 1: "w4a4_emulated", 2: "w4a4_native"}


class MoEGemmSpec(KernelSpec[MoEGemmProblem, Any]):
    """``kernels.moe.moe_gemm_kernel``: the grouped GEMM over expert tiles (GEMM 1 or GEMM 2)."""

    name = "fp4_moe_gemm"
    problem_type = MoEGemmProblem

    @property
    def config_type(self) -> type:  # type: ignore[override]
        from ...ops.moe import MoEGemmConfig

        return MoEGemmConfig

    def variant(self, problem: MoEGemmProblem, arch: Arch) -> str:
        return _MOE_VARIANTS[problem.act_on(arch)]

    def candidates(self, problem: MoEGemmProblem, arch: Arch) -> list:
        """block_n 32/64/128 (not beyond N; 128 only for tcgen05 W4A4, whose FP4 MMA is 128 rows
        tall); block_m 16, plus 64 above 16 rows per expert and 128 above 64 (the heuristic's
        ladder: a tile taller than an expert's rows is padding), or just the problem's block_m
        when the dispatch plan fixes it; block_k 64..256, not beyond K;
        4 warps, and 8 for tiles of 8,192 accumulators or more (weight rows x block_m);
        num_stages 1 or 3."""
        from ...ops.moe import MoEGemmConfig

        self.check_problem(problem)
        if problem.act_on(arch) == 2 and arch.fp4_mma == "tcgen05":
            block_ns: tuple[int, ...] = (128,)
        else:
            n_cap = max(32, _pow2_at_least(problem.N))
            block_ns = tuple(n for n in (32, 64, 128) if n <= n_cap)
        rpe = problem.pairs / problem.E
        block_ms = [16] + ([64] if rpe > 16 else []) + ([128] if rpe > 64 else [])
        if problem.block_m is not None:
            block_ms = [problem.block_m]
        k_cap = max(64, _pow2_at_least(problem.K))
        block_ks = [k for k in (64, 128, 256) if k <= k_cap]
        out = []
        for n in block_ns:
            rows = 2 * n if problem.gemm == 1 else n
            for m in block_ms:
                warps = (4,) if rows * m < 8192 else (4, 8)
                for k in block_ks:
                    for w in warps:
                        for s in (1, 3):
                            out.append(MoEGemmConfig(block_n=n, block_m=m, block_k=k, num_warps=w, num_stages=s))
        return out

    def heuristic(self, problem: MoEGemmProblem, arch: Arch, sm_count: int | None = None):
        from ...ops.moe import choose_moe_configs

        self.check_problem(problem)
        H, I = problem.hidden_and_intermediate()
        cfg = choose_moe_configs(problem.T, problem.top_k, problem.E, H, I, arch=arch, mode=problem.mode)[problem.gemm - 1]
        if problem.block_m is not None and cfg.block_m != problem.block_m:
            cfg = dataclasses.replace(cfg, block_m=problem.block_m)
        return cfg

    def smem_model(self, config, problem: MoEGemmProblem, arch: Arch) -> SmemBreakdown:
        self.check_config(config)
        return moe_smem(config.block_n, config.block_m, config.block_k, config.num_warps, config.num_stages,
                        gemm=problem.gemm, act=problem.act_on(arch), arch=arch,
                        group=get_format(problem.fmt).block_size, x_dtype=problem.x_dtype)

    def compile_request(self, config, problem: MoEGemmProblem, arch: Arch) -> CompileRequest:
        """``ops.moe.compile_request`` with the launcher's arguments: GEMM 1 gathers x and writes
        h in x's dtype; GEMM 2 scatters fp32 pair rows with the routing weight."""
        from ...ops.moe import compile_request

        act = problem.act_on(arch)
        g1 = problem.gemm == 1
        out_dtype = problem.x_dtype if g1 else "fp32"
        return compile_request(config, problem.fmt, arch.sm_version, swiglu=1 if g1 else 0, gather=g1,
                               scatter=not g1, out_dtype=out_dtype, act=act, x_dtype=problem.x_dtype)

    def expected_mma(self, problem: MoEGemmProblem, arch: Arch) -> MmaExpectation:
        """As ``fp4_linear``'s: W4A4 on SM100/SM103/SM120/SM121 must issue the native block-scaled
        FP4 MMA (``kind::mxf4nvf4``); everything else the architecture's bf16/fp16 MMA."""
        linear = LinearProblem(M=1, N=problem.N, K=problem.K, fmt=problem.fmt, mode=problem.mode,
                               x_dtype=problem.x_dtype)
        return get_kernel("fp4_linear").expected_mma(linear, arch)

    def model_time(self, config, problem: MoEGemmProblem, gpu: GPU, *, registers: int | None = None) -> TimeEstimate:
        """Roofline of the unique experts' weights against the padded FLOPs.

        Uniform routing: ``E_active = min(E, T * top_k)`` experts hold ``T * top_k / E_active``
        rows each, padded to ``block_m`` tiles (the dispatch plan). Programs: N tiles x row tiles.
        DRAM: every active expert's weight once (again per row tile when the weights are larger
        than half the L2), x once per unique row (GEMM 1 gathers the T tokens; GEMM 2 reads the
        pairs' h), the output once (GEMM 1 bf16 h, GEMM 2 fp32 pair rows). L2: each program's
        weight tile and rows. FLOPs over the FP4 peak for native W4A4, else the bf16 peak.
        """
        from ...target.roofline import fp4_weight_bytes

        arch = gpu.arch
        act = problem.act_on(arch)
        R, K, N = problem.pairs, problem.K, problem.N
        e_active = problem.active_experts
        rows_w = problem.weight_rows
        bn, bm = config.block_n, config.block_m
        rows_per_expert = _cdiv(R, e_active)
        tiles_per_expert = _cdiv(rows_per_expert, bm)
        row_tiles = e_active * tiles_per_expert
        tiles_n = _cdiv(N, bn)
        programs = tiles_n * row_tiles
        notes = [f"{e_active} active experts of {problem.E}, ~{rows_per_expert} rows each"]
        w_expert = fp4_weight_bytes(rows_w, K, problem.fmt)
        w_once = e_active * w_expert
        w_bytes = w_once
        if tiles_per_expert > 1 and w_once > gpu.l2_mib * 2**20 / 2:
            w_bytes *= tiles_per_expert
            notes.append(f"weights re-read from DRAM by {tiles_per_expert} row tiles per expert")
        x_row = K * 2 if act == 0 else K // 2 + K // 16
        x_rows = min(problem.T, R) if problem.gemm == 1 else R
        x_once = x_rows * x_row
        y_once = R * N * (2 if problem.gemm == 1 else 4)
        nbytes = w_bytes + x_once + y_once
        l2_bytes = tiles_per_expert * w_once + tiles_n * R * x_row + y_once
        flops = 2 * (row_tiles * bm) * (tiles_n * bn * (2 if problem.gemm == 1 else 1)) * K  # padded tiles
        peak = gpu.fp4_dense_tflops if act == 2 else gpu.bf16_dense_tflops
        if peak is None:
            raise ValueError(f"model_time: {gpu.name} has no FP4 peak in the catalogue; it cannot run "
                             f"{_MOE_VARIANTS[act]}")
        smem = self.smem_model(config, problem, arch).total
        ctas = arch.ctas_per_sm(32 * config.num_warps, registers=registers, smem_bytes=smem)
        us, limiter, waves = _roofline(gpu, nbytes=nbytes, flops=flops, peak_tflops=peak, programs=programs,
                                       ctas_per_sm=ctas, l2_bytes=l2_bytes)
        bound = max((w_once + x_once + y_once) / _bandwidth(gpu), 2 * R * rows_w * K / _mma_rate(peak))
        return TimeEstimate(us=us, bound_us=bound, limiter=limiter, programs=programs, waves=waves, ctas_per_sm=ctas,
                            bytes=nbytes, flops=flops, peak_tflops=peak, notes=tuple(notes))
