"""The kernel registry: for every kernel family, what can be tuned and what it costs.

A ``KernelSpec`` ties together, for one family of kernels:

* the problem it solves (a frozen dataclass, e.g. ``LinearProblem``) and its configuration type
  (e.g. ``ops.linear.LinearConfig``);
* ``candidates(problem, arch)``: the configurations worth considering;
* ``heuristic(problem, arch, sm_count)``: what the runtime picks without tuning;
* ``smem_model(config, problem, arch)``: shared memory, term by term (``plan.smem``);
* ``compile_request(config, problem, arch)``: how to cross-compile it (``plan.crosscompile``);
* ``expected_mma(problem, arch)``: the MMA instruction the PTX must contain;
* ``model_time(config, problem, gpu)``: a roofline estimate (bytes over bandwidth against
  FLOPs over peak, with waves over the SM count and the split-K reduction).

Registered: ``fp4_linear`` (paths w4a16, w4a4_emulated, w4a4_native), ``fp4_linear_mma`` (W4A16
decode on weights in MMA operand order, ``kernels.linear_mma``, Gluon), ``fp4_linear_wgmma`` (the
SM90 prefill kernel on weights in MMA operand order, ``kernels.gemm_wgmma``, Gluon), ``nvfp4_quantize``,
``nvfp4_dequantize`` (emulated W4A4's activations back to bf16), ``nvfp4_weight_dequantize`` (a
weight to bf16 for large-batch W4A16 on SM90, whose GEMM is torch's matmul),
``fp4_moe_gemm`` (the MoE layer's two grouped GEMMs, ``kernels.moe.moe_gemm_kernel``),
``fp4_moe_mma`` and ``fp4_moe_wgmma`` (the same GEMMs on the mma.sync kernel at decode and on the
wgmma kernel at SM90 prefill).
Later kernels add a spec with ``register``. Nothing here imports Triton or torch at import time.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, Literal, TypeVar

from ..arch import GPU, Arch, default_gpu
from ..formats import get_format
from .crosscompile import CompileRequest
from .smem import SmemBreakdown, linear_family, linear_smem, moe_smem, quantize_smem

__all__ = [
    "KERNELS",
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
    "TimeEstimate",
    "default_gpu",
    "get_kernel",
    "register",
]

Path = Literal["w4a16", "w4a4_emulated", "w4a4_native"]
_PATHS = ("w4a16", "w4a4_emulated", "w4a4_native")
_X_DTYPES = ("bf16", "fp16")

#: L2-to-SM bandwidth as a multiple of DRAM bandwidth (approximate: ~3x on recent NVIDIA parts,
#: e.g. H100 ~10-12 TB/s of L2 reads against 3.35 TB/s of HBM). Operand tiles that several
#: programs read (W by every M tile, x by every N tile) come from L2 at this rate.
L2_BANDWIDTH_FACTOR = 3.0

#: Time a second kernel adds besides its own traffic (launch gap and ramp-up inside a CUDA graph):
#: the split-K reduction pays it. Typical measured gaps between graph-launched kernels are 1-3 us.
SECOND_KERNEL_US = 2.0

#: Launch, ramp-up and drain of one kernel under CUDA-graph replay, beyond its bytes at the
#: sustained bandwidth (H200, W4A16 decode at M = 1 on the large GLM-5 shapes: 12.9-13.0 us
#: measured against 10.0-10.1 at copy bandwidth; 2.5 us on 6144x2048).
KERNEL_US = 2.5


def _bandwidth(gpu: GPU) -> float:
    """The catalogue's sustained DRAM bandwidth (``GPU.sustained_bandwidth_gbs``) in bytes per us."""
    return gpu.sustained_bandwidth_gbs * 1e3


def _mma_rate(peak_tflops: float) -> float:
    """FLOPs per microsecond that a datasheet peak sustains (``GPU.sustained_tflops``)."""
    return GPU.sustained_tflops(peak_tflops) * 1e6


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


# ------------------------------------------------------------------------------------------
# what every spec returns


@dataclass(frozen=True)
class MmaExpectation:
    """The tensor-core instruction a kernel's PTX must use on a target.

    ``alternatives``: an instruction satisfies the expectation when it contains every fragment of
    one alternative (e.g. ``("mma.sync.aligned.m16n8k64", "kind::mxf4nvf4", "block_scale")``).
    """

    description: str
    alternatives: tuple[tuple[str, ...], ...]

    def satisfied_by(self, mma: Sequence[str]) -> bool:
        return any(all(f in instr for f in alt) for instr in mma for alt in self.alternatives)

    def violation(self, mma: Sequence[str]) -> str | None:
        """Why ``mma`` (the PTX's MMA instructions) does not meet the expectation; None if it does."""
        if self.satisfied_by(mma):
            return None
        found = ", ".join(mma) if mma else "no MMA instruction at all"
        return f"expected {self.description}; the PTX has {found}"


@dataclass(frozen=True)
class TimeEstimate:
    """A roofline estimate of one configuration on one GPU (microseconds).

    ``bound_us`` is the problem's own roofline (least bytes at the sustained bandwidth against
    unpadded FLOPs at the sustained tensor rate, ``GPU.sustained_bandwidth_gbs`` and
    ``GPU.sustained_tflops``); ``us``
    adds what the configuration costs: padded tiles, waves, SMs left idle, the split-K partial
    sums and their reduction, and each kernel's launch and ramp (``KERNEL_US``).
    ``fraction = bound_us / us``. ``peak_tflops`` is the datasheet's. Against the H200's measured
    times (session 11, with the configurations that ran) the W4A16 linear's estimate is within
    1.02-1.24x at M <= 4 and M >= 1024 on the two large GLM-5 shapes, 0.87-1.31x at M = 64 to 16384
    elsewhere, and low by 1.3-1.8x at M = 16, at M <= 4 on 4096x6144 and at M = 256 on 4096x6144
    (benchmarks/linear-h200.json; ``tests/test_plan.py``); the MoE decode GEMMs' within 0.88-1.24x
    (ncu durations, benchmarks/raw/ncu). It ranks configurations; it does not predict every loss
    of a kernel."""

    us: float
    bound_us: float
    limiter: Literal["memory", "compute"]
    programs: int
    waves: int
    ctas_per_sm: int
    bytes: int
    flops: int
    peak_tflops: float
    notes: tuple[str, ...] = ()

    @property
    def fraction(self) -> float:
        return self.bound_us / self.us if self.us > 0 else 0.0


P = TypeVar("P")
C = TypeVar("C")


class KernelSpec(ABC, Generic[P, C]):
    """What the planner needs to know about one family of kernels (see the module docstring)."""

    name: str
    problem_type: type
    config_type: type

    @abstractmethod
    def candidates(self, problem: P, arch: Arch) -> list[C]: ...

    @abstractmethod
    def heuristic(self, problem: P, arch: Arch, sm_count: int | None = None) -> C: ...

    @abstractmethod
    def smem_model(self, config: C, problem: P, arch: Arch) -> SmemBreakdown: ...

    @abstractmethod
    def compile_request(self, config: C, problem: P, arch: Arch) -> CompileRequest: ...

    @abstractmethod
    def expected_mma(self, problem: P, arch: Arch) -> MmaExpectation | None: ...

    @abstractmethod
    def model_time(self, config: C, problem: P, gpu: GPU, *, registers: int | None = None) -> TimeEstimate: ...

    def variant(self, problem: P, arch: Arch) -> str:
        """The code path the problem takes on ``arch`` (for reports)."""
        return self.name

    def check_problem(self, problem: Any) -> P:
        if not isinstance(problem, self.problem_type):
            raise TypeError(f"{self.name}: expected a {self.problem_type.__name__}, got {type(problem).__name__}")
        return problem

    def check_config(self, config: Any) -> C:
        if not isinstance(config, self.config_type):
            raise TypeError(f"{self.name}: expected a {self.config_type.__name__}, got {type(config).__name__}")
        return config


def _elementwise_time(gpu: GPU, num_warps: int, *, nbytes: float, flops: float, programs: int,
                      registers: int | None, smem: int = 0, extra_us: float = 0.0, notes=()) -> TimeEstimate:
    """``TimeEstimate`` of an elementwise kernel (the quantizer, the dequantize kernels) of
    ``num_warps`` warps per program: its traffic against the bandwidth, its arithmetic on the CUDA
    cores, whose fp32 rate is roughly 1/16 of the dense bf16 tensor rate."""
    ctas = gpu.arch.ctas_per_sm(32 * num_warps, registers=registers, smem_bytes=smem)
    peak = gpu.bf16_dense_tflops / 16
    us, limiter, waves = _roofline(gpu, nbytes=nbytes, flops=flops, peak_tflops=peak, programs=programs,
                                   ctas_per_sm=ctas, extra_us=extra_us)
    return TimeEstimate(us=us, bound_us=nbytes / _bandwidth(gpu), limiter=limiter, programs=programs, waves=waves,
                        ctas_per_sm=ctas, bytes=nbytes, flops=flops, peak_tflops=peak, notes=tuple(notes))


def _roofline(gpu: GPU, *, nbytes: float, flops: float, peak_tflops: float, programs: int, ctas_per_sm: int,
              l2_bytes: float = 0.0, extra_us: float = 0.0) -> tuple[float, Literal["memory", "compute"], int]:
    """Time of one kernel: waves of programs over the SMs, bandwidth shared by the active SMs.

    Compute: programs are spread evenly over the SMs and the CTAs resident on one SM share its
    tensor cores, so the busiest SM runs ``ceil(programs / sm_count)`` programs at ``peak /
    sm_count``: quantisation over the SM count (``waves``, programs over resident slots, is
    reported). Memory: ``nbytes`` from DRAM and ``l2_bytes`` (every program's operand tiles)
    from L2 at ``L2_BANDWIDTH_FACTOR`` times the DRAM bandwidth; with fewer programs than SMs
    only that fraction of the SMs issue loads (one SM cannot draw the chip's bandwidth). Rates are
    the catalogue's sustained ones (``arch.SUSTAINED_BANDWIDTH_FRACTION``,
    ``arch.SUSTAINED_TENSOR_FRACTION``), plus ``KERNEL_US`` per kernel.
    """
    slots = gpu.sm_count * ctas_per_sm
    waves = _cdiv(programs, slots)
    per_sm = _cdiv(programs, gpu.sm_count)
    compute_us = per_sm * (flops / programs) / (_mma_rate(peak_tflops) / gpu.sm_count)
    busy = min(1.0, programs / gpu.sm_count)
    bandwidth = _bandwidth(gpu) * busy  # bytes per microsecond
    memory_us = max(nbytes / bandwidth, l2_bytes / (L2_BANDWIDTH_FACTOR * bandwidth))
    limiter: Literal["memory", "compute"] = "memory" if memory_us >= compute_us else "compute"
    return max(memory_us, compute_us) + KERNEL_US + extra_us, limiter, waves


# ------------------------------------------------------------------------------------------
# fp4_linear


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
        from ..ops.linear import target_path

        return target_path(self.mode, arch)

    def __str__(self) -> str:
        return f"M={self.M} N={self.N} K={self.K} {self.fmt} {self.mode}"


class LinearSpec(KernelSpec[LinearProblem, Any]):
    """``kernels.linear.fp4_linear_kernel`` (with ``splitk_reduce_kernel`` when K is split)."""

    name = "fp4_linear"
    problem_type = LinearProblem

    @property
    def config_type(self) -> type:  # type: ignore[override]
        from ..ops.linear import LinearConfig

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
        from ..ops.linear import LinearConfig

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
        from ..ops.linear import choose_config

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

        from ..ops.linear import compile_request

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
        from ..bench.roofline import fp4_weight_bytes

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


class _PackedSpec:
    """What the specs of the kernels on weights in MMA operand order (``ops.mma_layout``) share: W4A16
    with bf16 activations, or emulated W4A4 (bf16 or fp16 activations, on GPUs without FP4 MMA:
    ``ops.linear.runs_packed``), which runs the same kernels on its activations dequantized to bf16
    and keeps x's dtype for what the kernel writes (``_out_dtype``); ``_limit`` for the problems the
    runtime sends them (``_check_problem_size``)."""

    name: str

    def check_problem(self, problem: Any) -> Any:
        problem = super().check_problem(problem)  # type: ignore[misc]
        if problem.mode == "w4a16" and problem.x_dtype != "bf16":
            raise ValueError(f"{self.name}: runs W4A16 with bf16 activations, got {problem.x_dtype}")
        self._check_problem_size(problem)
        return problem

    def _check_mode(self, problem: Any, arch: Arch) -> None:
        """W4A4 runs here only where it is emulated (no FP4 MMA); elsewhere on native FP4 MMA."""
        from ..ops.linear import runs_packed

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
        from ..ops.mma_layout import MMAConfig

        return MMAConfig

    def variant(self, problem: Any, arch: Arch) -> str:
        return "w4a16_mma" if problem.mode == "w4a16" else "w4a4_emulated_mma"

    def smem_model(self, config, problem: Any, arch: Arch) -> SmemBreakdown:
        from ..ops.mma_layout import KCHUNK, _fit_kw, _split
        from .smem import SmemTerm

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
        from ..ops.mma_layout import WgmmaConfig

        return WgmmaConfig

    def variant(self, problem: Any, arch: Arch) -> str:
        return "w4a16_wgmma" if problem.mode == "w4a16" else "w4a4_emulated_wgmma"

    def _check_arch(self, arch: Arch) -> None:
        if arch.bf16_mma != "wgmma":
            raise ValueError(f"{self.name}: needs wgmma (SM90); {arch.name} has {arch.bf16_mma} "
                             "(its prefill runs the Triton kernels)")

    def smem_model(self, config, problem: Any, arch: Arch) -> SmemBreakdown:
        from ..ops.mma_layout import wgmma_smem_terms
        from .smem import SmemTerm

        self.check_config(config)  # type: ignore[attr-defined]
        return SmemBreakdown(tuple(SmemTerm(name, each, count, source="allocate_shared_memory")
                                   for name, each, count in wgmma_smem_terms(config, problem.fmt)))

    def expected_mma(self, problem: Any, arch: Arch) -> MmaExpectation:
        return MmaExpectation("bf16 wgmma (A from registers)", (("wgmma.mma_async", ".bf16"),))


def _uniform_tiles(problem: Any, block_m: int) -> tuple[int, int]:
    """(active experts, row tiles of ``block_m``) of an MoE problem under uniform routing."""
    experts = problem.active_experts
    return experts, experts * _cdiv(-(-problem.pairs // experts), block_m)


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
        from ..ops.mma_layout import MAX_M

        if problem.M > MAX_M:
            raise ValueError(f"{self.name}: runs decode, M <= {MAX_M}, got M = {problem.M}")

    def candidates(self, problem: LinearProblem, arch: Arch, sm_count: int | None = None) -> list:
        """What the runtime's decode heuristic chooses from: K split over 2, 4 or 8 warp groups of
        one program, one or two 16-row blocks per warp, 128 or 256 K per step (PDL as the heuristic
        launches it; 8-token NVFP4 programs with PDL = 3 also with x read per chunk, ``MMAConfig.xc``),
        and the heuristic's own choice; for K too short to split over warps, the heuristic's one
        program per tile."""
        from ..formats import NVFP4, get_format
        from ..ops.mma_layout import MMAConfig, coresident_rule

        chosen = self.heuristic(problem, arch, sm_count)
        if chosen.kw == 1:
            return [chosen]
        mx = get_format(problem.fmt) is not NVFP4
        xcs = (False, True) if coresident_rule(mx, chosen.block_m, chosen.pdl == 3) else (False,)
        family = [MMAConfig(rb=rb, warps=1, kh=kh, block_m=chosen.block_m, kw=kw, pdl=chosen.pdl, xc=xc)
                  for rb in (1, 2) for kh in (2, 4) for kw in (2, 4, 8) for xc in xcs]
        return family + [chosen] * (chosen not in family)  # with its x ring, where it takes one

    def heuristic(self, problem: LinearProblem, arch: Arch, sm_count: int | None = None):
        from ..ops.mma_layout import choose_mma_config

        self.check_problem(problem)
        self._check_mode(problem, arch)
        gpu = default_gpu(arch)
        return choose_mma_config(problem.M, problem.N, problem.K, sm_count or gpu.sm_count, fmt=problem.fmt,
                                 arch=arch, l2_bytes=int(gpu.l2_mib * 2**20))

    def compile_request(self, config, problem: LinearProblem, arch: Arch) -> CompileRequest:
        from ..ops.mma_layout import mma_compile_request

        self._check_mode(problem, arch)
        return mma_compile_request(config, problem.fmt, arch.sm_version, problem.K, has_bias=problem.has_bias,
                                   out_dtype=self._out_dtype(problem))

    def model_time(self, config, problem: LinearProblem, gpu: GPU, *, registers: int | None = None) -> TimeEstimate:
        from ..bench.roofline import fp4_weight_bytes
        from ..ops.mma_layout import KCHUNK, _split

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
        batches (M <= ``WGMMA_SPLIT_MAX_M``): also the one 16- to 64-row tile that holds every row (the
        H200 sweep measured no gain from several shorter ones), K split 1 to 8 ways."""
        from ..ops.mma_layout import WGMMA_SPLIT_MAX_M, WgmmaConfig, persistent_where_possible

        self.check_problem(problem)
        self._check_arch(arch)
        self._check_mode(problem, arch)
        small = []
        if problem.M <= WGMMA_SPLIT_MAX_M:
            m = min(64, max(16, 1 << (problem.M - 1).bit_length()))
            small = [WgmmaConfig(block_m=m, stages=s, warps=w, split_k=k) for w in (4, 8) for s in (4, 6)
                     for k in (1, 2, 3, 4, 6, 8)]
        return small + [WgmmaConfig(block_m=m, stages=s, warps=w) for m in (64, 128) for w in (4, 8)
                        for s in (3, 4, 5, 6)] \
            + [persistent_where_possible(WgmmaConfig(block_m=m, stages=s, warps=8, repeats=1), problem.K)
               for m in (64, 128, 256) for s in (3, 4, 5, 6)]

    def heuristic(self, problem: LinearProblem, arch: Arch, sm_count: int | None = None):
        from ..ops.mma_layout import choose_wgmma_config

        self.check_problem(problem)
        self._check_arch(arch)
        self._check_mode(problem, arch)
        return choose_wgmma_config(problem.M, problem.N, problem.K, sm_count or 132)

    def compile_request(self, config, problem: LinearProblem, arch: Arch) -> CompileRequest:
        from ..ops.mma_layout import wgmma_compile_request

        self._check_mode(problem, arch)
        return wgmma_compile_request(config, problem.fmt, arch.sm_version, has_bias=problem.has_bias,
                                     wg_mode=1 if get_format(problem.fmt).has_global_scale else 0,
                                     out_dtype=self._out_dtype(problem))

    def model_time(self, config, problem: LinearProblem, gpu: GPU, *, registers: int | None = None) -> TimeEstimate:
        from ..bench.roofline import fp4_weight_bytes

        from ..ops.mma_layout import KCHUNK, wgmma_split

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


# ------------------------------------------------------------------------------------------
# nvfp4_quantize


def _check_activations(problem) -> None:
    """What the activation kernels' problems (quantize, dequantize) share: M and K positive ints,
    K a whole number of NVFP4 blocks."""
    kind = type(problem).__name__
    for name in ("M", "K"):
        v = getattr(problem, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{kind}.{name}: expected a positive int, got {v!r}")
    if problem.K % 16:
        raise ValueError(f"{kind}.K: expected a multiple of 16 (the NVFP4 block), got {problem.K}")


@dataclass(frozen=True)
class QuantizeProblem:
    """Quantize activations x [M, K] to NVFP4 (``ops.quantize.quantize_activations``).

    ``dynamic``: the global scale is computed from amax on the device (a first, absmax pass).
    ``values_out``: the codes' bf16 values are written instead of the codes, for emulated W4A4
    (``ops.quantize.fake_quantize_activations``: ``nvfp4_fake_quantize_kernel``, same tiles), with
    g times ``weight_globals`` weight global scales (1 for a linear, the local experts for an MoE).
    """

    M: int
    K: int
    x_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    dynamic: bool = True
    values_out: bool = False
    weight_globals: int = 1

    def __post_init__(self) -> None:
        _check_activations(self)
        if self.x_dtype not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"QuantizeProblem.x_dtype: expected 'bf16', 'fp16' or 'fp32', got {self.x_dtype!r}")

    def __str__(self) -> str:
        return f"M={self.M} K={self.K} {self.x_dtype}" + (" -> bf16 values" if self.values_out else "")


def _weight_globals_constexprs(weight_globals: int) -> dict[str, Any]:
    """``HAS_WG``/``BLOCK_G`` as the activation launchers set them for that many weight global scales
    (one for a linear, one per local expert): the kernel multiplies up to ``MAX_WEIGHT_GLOBALS``
    of them into g; more (per-row globals) torch multiplies after it, and none gives g alone."""
    from ..ops.quantize import MAX_WEIGHT_GLOBALS

    if not 1 <= weight_globals <= MAX_WEIGHT_GLOBALS:
        return {"HAS_WG": False, "BLOCK_G": 1}
    return {"HAS_WG": True, "BLOCK_G": _pow2_at_least(weight_globals)}


_QUANTIZE_KERNEL = ("fp4moe.kernels.quantize", "nvfp4_quantize_kernel")
_FAKE_QUANTIZE_KERNEL = ("fp4moe.kernels.quantize", "nvfp4_fake_quantize_kernel")


def _jit_parameters(module: str, function: str) -> list[tuple[str, bool]]:
    """(name, is_constexpr) of a @triton.jit function's parameters, read from its source file
    (nothing imported: the kernel file may change under us, the request must follow it)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"cannot find the source of {module}")
    tree = ast.parse(open(spec.origin).read())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return [(a.arg, a.annotation is not None and "constexpr" in ast.unparse(a.annotation))
                    for a in node.args.args]
    raise ValueError(f"{module} has no function {function}")


def _source_request(spec_name: str, kernel: tuple[str, str], types: Mapping[str, str], values: Mapping[str, Any],
                    divisible: Sequence[str], arch: Arch, num_warps: int, maxnreg: int | None = None) -> CompileRequest:
    """A compile request whose signature and constexprs follow the @triton.jit function's parameter
    list as it stands in its source (``_jit_parameters``): ``types`` for the runtime arguments,
    ``values`` for the constexprs; a parameter in neither is an error naming it."""
    module, function = kernel
    signature, constexprs = {}, {}
    for name, is_constexpr in _jit_parameters(module, function):
        table = values if is_constexpr else types
        if name not in table:
            raise ValueError(f"{spec_name}: {function} has a parameter {name!r} that "
                             f"fp4moe.plan.space does not know how to {'set' if is_constexpr else 'type'}")
        (constexprs if is_constexpr else signature)[name] = table[name]
    return CompileRequest(kernel=f"{module}:{function}", signature=signature, constexprs=constexprs,
                          cc=arch.sm_version, num_warps=num_warps, num_stages=1,
                          divisible_by_16=tuple(a for a in divisible if a in signature), maxnreg=maxnreg)


class QuantizeSpec(KernelSpec[QuantizeProblem, Any]):
    """``kernels.quantize.nvfp4_quantize_kernel`` (and its absmax pass, when dynamic, in the time model)."""

    name = "nvfp4_quantize"
    problem_type = QuantizeProblem

    @property
    def config_type(self) -> type:  # type: ignore[override]
        from ..ops.quantize import QuantizeConfig

        return QuantizeConfig

    def candidates(self, problem: QuantizeProblem, arch: Arch) -> list:
        """block_k 64..512 (not beyond K), block_m a power of two up to M with 1,024..16,384 elements
        per tile, and warps giving each thread 8..64 elements."""
        from ..ops.quantize import QuantizeConfig

        self.check_problem(problem)
        out = []
        k_cap = max(16, _pow2_at_least(problem.K))
        m_cap = _pow2_at_least(problem.M)
        for bk in (64, 128, 256, 512):
            if bk > k_cap:
                continue
            bm = 1
            while bm <= m_cap:
                if 1024 <= bm * bk <= 16384 or (bm == m_cap and bm * bk < 1024):
                    for w in (1, 2, 4, 8):
                        if 8 <= bm * bk // (32 * w) <= 64:
                            out.append(QuantizeConfig(block_m=bm, block_k=bk, num_warps=w))
                bm *= 2
        return out

    def heuristic(self, problem: QuantizeProblem, arch: Arch, sm_count: int | None = None):
        from ..ops.quantize import QuantizeConfig

        self.check_problem(problem)
        import torch

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[problem.x_dtype]
        cfg = QuantizeConfig.from_heuristic(problem.M, problem.K, dtype)
        # the register cap is the code-writing kernel's: fake_quantize_activations runs uncapped
        return dataclasses.replace(cfg, maxnreg=None) if problem.values_out else cfg

    def smem_model(self, config, problem: QuantizeProblem, arch: Arch) -> SmemBreakdown:
        self.check_config(config)
        return quantize_smem(config.block_m, config.block_k, config.num_warps, problem.x_dtype)

    def compile_request(self, config, problem: QuantizeProblem, arch: Arch) -> CompileRequest:
        """The request, built from the kernel's parameter list as it stands in its source file
        (``values_out``: the fake-quantize kernel, uncapped as its launcher runs it, with the
        problem's weight globals)."""
        from ..ops.quantize import absmax_partials

        types = {"x_ptr": f"*{problem.x_dtype}", "data_ptr": "*i32", "scales_ptr": "*u8", "scale_ptr": "*fp32",
                 "gs_out_ptr": "*fp32", "M": "i32", "K": "i32", "stride_xm": "i32", "n_part": "i32",
                 "out_ptr": "*bf16", "wg_ptr": "*fp32", "g_out_ptr": "*fp32", "stride_om": "i32", "G": "i32"}
        # a dynamic scale at decode sizes arrives as the absmax pass's partial maxima, as the launcher does it
        n_part = absmax_partials(problem.M, problem.K, config) if problem.dynamic else 1
        values = {"BLOCK_M": config.block_m, "BLOCK_K": config.block_k, "DYNAMIC": problem.dynamic,
                  "SM86": arch.has_xorsign_abs_max,  # as the launcher sets it from the device
                  "EMULATE_FMA": False,  # compiled CUDA has a fused multiply-add
                  "PDL": arch.has_pdl, "BLOCK_P": _pow2_at_least(n_part),
                  **_weight_globals_constexprs(problem.weight_globals)}
        if problem.values_out:
            return _source_request(self.name, _FAKE_QUANTIZE_KERNEL, types, values,
                                   ("x_ptr", "out_ptr", "K", "stride_xm", "stride_om"), arch, config.num_warps)
        return _source_request(self.name, _QUANTIZE_KERNEL, types, values,
                               ("x_ptr", "data_ptr", "scales_ptr", "K", "stride_xm"), arch, config.num_warps,
                               config.maxnreg)

    def expected_mma(self, problem: QuantizeProblem, arch: Arch) -> None:
        return None  # elementwise: no tensor cores

    def model_time(self, config, problem: QuantizeProblem, gpu: GPU, *, registers: int | None = None) -> TimeEstimate:
        M, K = problem.M, problem.K
        xb = {"bf16": 2, "fp16": 2, "fp32": 4}[problem.x_dtype]
        programs = _cdiv(M, config.block_m) * _cdiv(K, config.block_k)
        nbytes = M * K * xb + (M * K * 2 if problem.values_out else M * K // 2 + M * K // 16)
        notes = []
        extra = 0.0
        if problem.dynamic:  # absmax pass: reads x once more, one more kernel
            extra = M * K * xb / _bandwidth(gpu) + SECOND_KERNEL_US
            notes.append("dynamic global scale: an absmax pass reads x first")
        smem = self.smem_model(config, problem, gpu.arch).total
        flops = 30 * M * K  # ~30 fp32 operations per element (scale, divide by reciprocal, round, pack)
        return _elementwise_time(gpu, config.num_warps, nbytes=nbytes, flops=flops, programs=programs,
                                 registers=registers, smem=smem, extra_us=extra, notes=notes)


# ------------------------------------------------------------------------------------------
# nvfp4_dequantize


@dataclass(frozen=True)
class DequantizeProblem:
    """NVFP4 activations [M, K] back to bf16 for emulated W4A4 (``ops.quantize.dequantize_activations``):
    ``mma_order`` writes them padded to 64 in the packed weights' K order, for the wgmma kernel;
    ``weight_globals`` as ``QuantizeProblem``'s."""

    M: int
    K: int
    mma_order: bool = False
    weight_globals: int = 1

    def __post_init__(self) -> None:
        _check_activations(self)

    @property
    def k_out(self) -> int:
        return _cdiv(self.K, 64) * 64 if self.mma_order else self.K

    def __str__(self) -> str:
        return f"M={self.M} K={self.K}" + (" MMA order" if self.mma_order else "")


_DEQUANTIZE_KERNEL = ("fp4moe.kernels.quantize", "nvfp4_dequantize_kernel")


class DequantizeSpec(KernelSpec[DequantizeProblem, Any]):
    """``kernels.quantize.nvfp4_dequantize_kernel``: one row per program, elementwise, no shared memory."""

    name = "nvfp4_dequantize"
    problem_type = DequantizeProblem

    @property
    def config_type(self) -> type:  # type: ignore[override]
        from ..ops.quantize import DequantizeConfig

        return DequantizeConfig

    def candidates(self, problem: DequantizeProblem, arch: Arch) -> list:
        """256..2,048 columns per program, 4..32 elements per thread."""
        from ..ops.quantize import DequantizeConfig

        self.check_problem(problem)
        return [DequantizeConfig(block_k=bk, num_warps=w) for bk in (256, 512, 1024, 2048) for w in (1, 2, 4, 8)
                if 4 <= bk // (32 * w) <= 32]

    def heuristic(self, problem: DequantizeProblem, arch: Arch, sm_count: int | None = None):
        from ..ops.quantize import DequantizeConfig

        self.check_problem(problem)
        return DequantizeConfig()  # what dequantize_activations runs

    def smem_model(self, config, problem: DequantizeProblem, arch: Arch) -> SmemBreakdown:
        self.check_config(config)
        return SmemBreakdown(())  # one row per program: every tensor keeps one layout

    def compile_request(self, config, problem: DequantizeProblem, arch: Arch) -> CompileRequest:
        """The request, built from the kernel's parameter list as it stands in its source file, with
        the problem's weight globals (``_weight_globals_constexprs``)."""
        types = {"data_ptr": "*u8", "scales_ptr": "*u8", "xg_ptr": "*fp32", "wg_ptr": "*fp32", "out_ptr": "*bf16",
                 "g_out_ptr": "*fp32", "M": "i32", "K": "i32", "K_OUT": "i32", "stride_dm": "i32",
                 "stride_sm": "i32", "stride_om": "i32", "G": "i32"}
        values = {"BLOCK_K": config.block_k, **_weight_globals_constexprs(problem.weight_globals),
                  "MMA_ORDER": problem.mma_order,
                  "PDL": arch.has_pdl}
        return _source_request(self.name, _DEQUANTIZE_KERNEL, types, values, ("data_ptr", "scales_ptr", "out_ptr", "K"),
                               arch, config.num_warps)

    def expected_mma(self, problem: DequantizeProblem, arch: Arch) -> None:
        return None  # elementwise: no tensor cores

    def model_time(self, config, problem: DequantizeProblem, gpu: GPU, *,
                   registers: int | None = None) -> TimeEstimate:
        M, K, k_out = problem.M, problem.K, problem.k_out
        programs = M * _cdiv(k_out, config.block_k)
        nbytes = M * K // 2 + M * K // 16 + M * k_out * 2  # codes and scales in, bf16 out
        flops = 6 * M * k_out  # decode, scale, convert: a few CUDA-core operations per element
        return _elementwise_time(gpu, config.num_warps, nbytes=nbytes, flops=flops, programs=programs,
                                 registers=registers)


# ------------------------------------------------------------------------------------------
# nvfp4_weight_dequantize


@dataclass(frozen=True)
class WeightDequantizeProblem:
    """A contiguous NVFP4 weight [N, K] to bf16 without its global scale
    (``ops.quantize.dequantize_weight``): the first half of ``fp4_linear``'s large-batch path on SM90
    (``ops.linear.dequant_matmul_applies``), whose GEMM is torch's bf16 matmul (cuBLAS, not planned)."""

    N: int
    K: int

    def __post_init__(self) -> None:
        if self.N < 1 or self.K < 16 or self.K % 16:
            raise ValueError(f"expected N >= 1 and K a multiple of 16, got N={self.N} K={self.K}")

    def __str__(self) -> str:
        return f"N={self.N} K={self.K} -> bf16 (then torch.matmul)"


_WEIGHT_DEQUANTIZE_KERNEL = ("fp4moe.kernels.quantize", "nvfp4_weight_dequantize_kernel")


class WeightDequantizeSpec(KernelSpec[WeightDequantizeProblem, Any]):
    """``kernels.quantize.nvfp4_weight_dequantize_kernel``: runs of bytes over the flat arrays,
    elementwise; its only shared memory is a layout conversion the compiler inserts."""

    name = "nvfp4_weight_dequantize"
    problem_type = WeightDequantizeProblem

    @property
    def config_type(self) -> type:  # type: ignore[override]
        from ..ops.quantize import WeightDequantizeConfig

        return WeightDequantizeConfig

    def candidates(self, problem: WeightDequantizeProblem, arch: Arch) -> list:
        """1,024..8,192 bytes per program, 8..64 bytes per thread."""
        from ..ops.quantize import WeightDequantizeConfig

        self.check_problem(problem)
        return [WeightDequantizeConfig(block=b, num_warps=w) for b in (1024, 2048, 4096, 8192) for w in (2, 4, 8)
                if 8 <= b // (32 * w) <= 64]

    def heuristic(self, problem: WeightDequantizeProblem, arch: Arch, sm_count: int | None = None):
        from ..ops.quantize import WeightDequantizeConfig

        self.check_problem(problem)
        return WeightDequantizeConfig()  # what dequantize_weight runs

    def smem_model(self, config, problem: WeightDequantizeProblem, arch: Arch) -> SmemBreakdown:
        """No buffer of its own; the compiler moves the values from the byte loads' layout (16 bytes
        per thread) to the 32-bit stores' (4 words) through a scratch of 16 bytes per thread, 32 where
        a thread has only 8 bytes (Triton 3.6, SM80/90/120, every candidate)."""
        from .smem import SmemTerm

        self.check_config(config)
        threads = 32 * config.num_warps
        scratch = 16 * threads * (2 if config.block // threads < 16 else 1)
        return SmemBreakdown((SmemTerm("bytes -> words layout conversion", scratch,
                                       source="convert_layout scratch (load and store layouts differ)"),))

    def compile_request(self, config, problem: WeightDequantizeProblem, arch: Arch) -> CompileRequest:
        types = {"data_ptr": "*u8", "scales_ptr": "*u8", "out_ptr": "*i32", "n_bytes": "i32"}
        values = {"BLOCK": config.block, "PDL": arch.has_pdl}
        n_bytes = problem.N * problem.K // 2  # the runtime specialises it where it is a multiple of 16
        divisible = ("data_ptr", "scales_ptr", "out_ptr") + (("n_bytes",) if n_bytes % 16 == 0 else ())
        return _source_request(self.name, _WEIGHT_DEQUANTIZE_KERNEL, types, values, divisible, arch, config.num_warps)

    def expected_mma(self, problem: WeightDequantizeProblem, arch: Arch) -> None:
        return None  # elementwise: no tensor cores

    def model_time(self, config, problem: WeightDequantizeProblem, gpu: GPU, *,
                   registers: int | None = None) -> TimeEstimate:
        n = problem.N * problem.K
        programs = _cdiv(n // 2, config.block)
        nbytes = n // 2 + n // 16 + n * 2  # codes and scales in, bf16 out
        return _elementwise_time(gpu, config.num_warps, nbytes=nbytes, flops=6 * n, programs=programs,
                                 registers=registers, smem=self.smem_model(config, problem, gpu.arch).total)


# ------------------------------------------------------------------------------------------
# fp4_moe_gemm


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
        from ..ops.dispatch import check_rows

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
        from ..ops.moe import MoEGemmConfig

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
        from ..ops.moe import MoEGemmConfig

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
        from ..ops.moe import choose_moe_configs

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
        from ..ops.moe import compile_request

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
        return _LINEAR.expected_mma(linear, arch)

    def model_time(self, config, problem: MoEGemmProblem, gpu: GPU, *, registers: int | None = None) -> TimeEstimate:
        """Roofline of the unique experts' weights against the padded FLOPs.

        Uniform routing: ``E_active = min(E, T * top_k)`` experts hold ``T * top_k / E_active``
        rows each, padded to ``block_m`` tiles (the dispatch plan). Programs: N tiles x row tiles.
        DRAM: every active expert's weight once (again per row tile when the weights are larger
        than half the L2), x once per unique row (GEMM 1 gathers the T tokens; GEMM 2 reads the
        pairs' h), the output once (GEMM 1 bf16 h, GEMM 2 fp32 pair rows). L2: each program's
        weight tile and rows. FLOPs over the FP4 peak for native W4A4, else the bf16 peak.
        """
        from ..bench.roofline import fp4_weight_bytes

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


# ------------------------------------------------------------------------------------------
# registry

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
        from ..ops.mma_layout import MAX_M

        if problem.pairs / problem.E > MAX_M:
            raise ValueError(f"{self.name}: runs decode, <= {MAX_M} rows per expert, got {problem.pairs / problem.E:.1f}")

    def candidates(self, problem: MoEGemmProblem, arch: Arch) -> list:
        from ..ops.mma_layout import MMAConfig

        self.check_problem(problem)
        self._check_mode(problem, arch)
        block_ms = (problem.block_m,) if problem.block_m in (8, 16) else (8, 16)
        return [MMAConfig(rb=rb, warps=4, kh=kh, block_m=bm, split_k=1) for bm in block_ms for rb in (1, 2)
                for kh in (1, 2, 4)]

    def heuristic(self, problem: MoEGemmProblem, arch: Arch, sm_count: int | None = None):
        """The runtime's configuration (``ops.moe.mma_moe_layer_config``; GEMM 2's through
        ``mma_moe_gemm2_config``): where it runs two launches (``MMAHeights``), that of the problem's
        class (``rows``), or without one the large tiles' (the dispatch plan's height)."""
        from ..ops.moe import MMAHeights, mma_moe_gemm2_config, mma_moe_layer_config

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
        from ..ops.mma_layout import KCHUNK, mma_compile_request
        from ..ops.moe import MOE_WORD_ORDER, mma_pair_rows, overlaps_previous_class

        # GEMM 1 with its SiLU epilogue in the kernel (``ops.moe.fuses_swiglu``; gate-then-up weights,
        # one global per expert for NVFP4, none for MXFP4: the presets' checkpoints)
        self._check_mode(problem, arch)
        return mma_compile_request(config, problem.fmt, arch.sm_version, problem.K, grouped=True,
                                   gather=problem.gemm == 1, plan_ready=problem.gemm == 2,
                                   independent=overlaps_previous_class(problem.rows),
                                   swiglu=self._fused(config, problem, default_gpu(arch).sm_count),
                                   wg_mode=1 if problem.fmt == "nvfp4" else 0, out_dtype=self._out_dtype(problem),
                                   order=MOE_WORD_ORDER,
                                   part_dtype=mma_pair_rows(config, -(-problem.K // KCHUNK), problem.x_dtype)
                                   if problem.gemm == 2 else "fp32")

    @staticmethod
    def _fused(config, problem: MoEGemmProblem, sm_count: int) -> bool:
        """As the runtime decides (``ops.moe.fuses_swiglu``) on a GPU of ``sm_count`` SMs. The compile
        request sees only the architecture and takes its catalogue product's SM count, so for another
        product of the architecture near the threshold it may compile the other variant than
        ``model_time`` models (and the registers it reports are that variant's: 121 against 72 on
        SM90)."""
        from ..ops.dispatch import max_tiles
        from ..ops.moe import MMAHeights, fused_programs_per_sm, fuses_swiglu, mma_moe_layer_config

        pairs = problem.T * problem.top_k
        if problem.rows is not None:  # both launches of MMAHeights: as the large class's plan decides
            layer = mma_moe_layer_config(pairs / problem.E, problem.E)
            config = layer.large if isinstance(layer, MMAHeights) else config
        tiles = max_tiles(pairs, problem.E, config.block_m)
        return problem.gemm == 1 and fuses_swiglu(config, "silu", False, problem.N,
                                                  fused_programs_per_sm(tiles, problem.N, config, sm_count))

    def model_time(self, config, problem: MoEGemmProblem, gpu: GPU, *, registers: int | None = None) -> TimeEstimate:
        from ..bench.roofline import fp4_weight_bytes

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
        from ..ops.mma_layout import WgmmaConfig

        self.check_problem(problem)
        self._check_arch(arch)
        self._check_mode(problem, arch)
        return [WgmmaConfig(block_m=m, stages=s, warps=w) for m in self._block_ms(problem) for w in (4, 8)
                for s in (3, 4, 5, 6)]

    def heuristic(self, problem: MoEGemmProblem, arch: Arch, sm_count: int | None = None):
        from ..ops.moe import wgmma_gemm2_config, wgmma_moe_config

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
        from ..ops.mma_layout import wgmma_compile_request
        from ..ops.moe import MOE_WORD_ORDER

        self._check_mode(problem, arch)
        # emulated W4A4 (``ops.moe._run_wgmma`` with its re-quantization): GEMM 1 writes h in K order
        # and in x's dtype; the dequantize kernel then puts it into GEMM 2's MMA K order
        gemm1 = problem.gemm == 1
        return wgmma_compile_request(config, problem.fmt, arch.sm_version, gemm=f"gemm{problem.gemm}",
                                     wg_mode=1 if get_format(problem.fmt).has_global_scale else 0,
                                     out_dtype=self._out_dtype(problem) if gemm1 else "bf16",
                                     out_mma_order=gemm1 and problem.mode == "w4a16", order=MOE_WORD_ORDER)

    def model_time(self, config, problem: MoEGemmProblem, gpu: GPU, *, registers: int | None = None) -> TimeEstimate:
        from ..bench.roofline import fp4_weight_bytes

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


_KERNELS: dict[str, KernelSpec] = {}
KERNELS: Mapping[str, KernelSpec] = MappingProxyType(_KERNELS)
"""Every registered kernel family, by name."""


def register(spec: KernelSpec) -> KernelSpec:
    """Add a kernel family to the registry (its name must be new)."""
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"register: expected a KernelSpec, got {type(spec).__name__}")
    if spec.name in _KERNELS:
        raise ValueError(f"register: a kernel named {spec.name!r} is already registered")
    _KERNELS[spec.name] = spec
    return spec


def get_kernel(name: str | KernelSpec) -> KernelSpec:
    """The registered spec called ``name`` (a spec passes through)."""
    if isinstance(name, KernelSpec):
        return name
    try:
        return _KERNELS[name]
    except KeyError:
        raise ValueError(f"get_kernel: no kernel named {name!r}; registered: {', '.join(_KERNELS)}") from None


_LINEAR = register(LinearSpec())
register(MmaLinearSpec())
register(WgmmaLinearSpec())
register(QuantizeSpec())
register(DequantizeSpec())
register(WeightDequantizeSpec())
register(MoEGemmSpec())
register(MmaMoESpec())
register(WgmmaMoESpec())
