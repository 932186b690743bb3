"""What every kernel family's spec shares: ``KernelSpec``, ``MmaExpectation``, ``TimeEstimate``,
the roofline estimates, and the registry (``KERNELS``, ``register``, ``get_kernel``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, Literal, TypeVar

from ...target import GPU, Arch
from ...target.compile_request import CompileRequest
from ...target.smem import SmemBreakdown

Path = Literal["w4a16", "w4a4_emulated", "w4a4_native"]
_PATHS = ("w4a16", "w4a4_emulated", "w4a4_native")
_X_DTYPES = ("bf16", "fp16")

#: L2-to-SM bandwidth as a multiple of DRAM bandwidth (approximate: ~3x on recent NVIDIA parts,
#: e.g. H100 ~10-12 TB/s of L2 reads against 3.35 TB/s of HBM). Operand tiles that several
#: programs read (W by every M tile, x by every N tile) come from L2 at this rate.
L2_BANDWIDTH_FACTOR = 3.0

#: Time a second kernel adds besides its own traffic (launch gap and ramp-up inside a CUDA graph):
#: the split-K reduction pays it (docs/performance-engineering.md, ``SECOND_KERNEL_US``).
SECOND_KERNEL_US = 2.0

#: Launch, ramp-up and drain of one kernel under CUDA-graph replay, beyond its bytes at the
#: sustained bandwidth (docs/performance-engineering.md, ``KERNEL_US``).
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
    ``fraction = bound_us / us``. ``peak_tflops`` is the datasheet's. It ranks configurations; it
    does not predict every loss of a kernel (its error against measured times:
    docs/performance-engineering.md, ``TimeEstimate``; ``tests/test_plan.py``)."""

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
