"""The elementwise kernels of ``kernels.quantize``: ``nvfp4_quantize`` (activations to NVFP4, or to
their bf16 values for emulated W4A4), ``nvfp4_dequantize`` (emulated W4A4's activations back to
bf16) and ``nvfp4_weight_dequantize`` (a weight to bf16 for large-batch W4A16 on SM90). Their
compile requests follow each @triton.jit function's parameter list as it stands in its source."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ...target import GPU, Arch
from ...target.compile_request import CompileRequest
from ...target.smem import SmemBreakdown, quantize_smem
from .base import SECOND_KERNEL_US, KernelSpec, TimeEstimate, _bandwidth, _cdiv, _elementwise_time, _pow2_at_least

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
    from ...ops.quantize import MAX_WEIGHT_GLOBALS

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
        from ...ops.quantize import QuantizeConfig

        return QuantizeConfig

    def candidates(self, problem: QuantizeProblem, arch: Arch) -> list:
        """block_k 64..512 (not beyond K), block_m a power of two up to M with 1,024..16,384 elements
        per tile, and warps giving each thread 8..64 elements."""
        from ...ops.quantize import QuantizeConfig

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
        from ...ops.quantize import QuantizeConfig

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
        from ...ops.quantize import absmax_partials

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
        from ...ops.quantize import DequantizeConfig

        return DequantizeConfig

    def candidates(self, problem: DequantizeProblem, arch: Arch) -> list:
        """256..2,048 columns per program, 4..32 elements per thread."""
        from ...ops.quantize import DequantizeConfig

        self.check_problem(problem)
        return [DequantizeConfig(block_k=bk, num_warps=w) for bk in (256, 512, 1024, 2048) for w in (1, 2, 4, 8)
                if 4 <= bk // (32 * w) <= 32]

    def heuristic(self, problem: DequantizeProblem, arch: Arch, sm_count: int | None = None):
        from ...ops.quantize import DequantizeConfig

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
        from ...ops.quantize import WeightDequantizeConfig

        return WeightDequantizeConfig

    def candidates(self, problem: WeightDequantizeProblem, arch: Arch) -> list:
        """1,024..8,192 bytes per program, 8..64 bytes per thread."""
        from ...ops.quantize import WeightDequantizeConfig

        self.check_problem(problem)
        return [WeightDequantizeConfig(block=b, num_warps=w) for b in (1024, 2048, 4096, 8192) for w in (2, 4, 8)
                if 8 <= b // (32 * w) <= 64]

    def heuristic(self, problem: WeightDequantizeProblem, arch: Arch, sm_count: int | None = None):
        from ...ops.quantize import WeightDequantizeConfig

        self.check_problem(problem)
        return WeightDequantizeConfig()  # what dequantize_weight runs

    def smem_model(self, config, problem: WeightDequantizeProblem, arch: Arch) -> SmemBreakdown:
        """No buffer of its own; the compiler moves the values from the byte loads' layout (16 bytes
        per thread) to the 32-bit stores' (4 words) through a scratch of 16 bytes per thread, 32 where
        a thread has only 8 bytes (Triton 3.6, SM80/90/120, every candidate)."""
        from ...target.smem import SmemTerm

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
