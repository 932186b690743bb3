"""NVFP4 activation quantization on the GPU (Triton), bit-identical to ``fp4moe.quantize``.

``quantize_activations(x, global_scale)`` returns exactly what
``quantize_activations_reference(x, global_scale)`` (= ``fp4moe.quantize(x, "nvfp4", global_scale)``)
returns on x's device: the same packed codes, E4M3 block-scale bits and global scale.

The hot path never synchronises with the host: a given global scale is read by the kernel
from device memory, and the dynamic one (``amax(|x|) / (6 * 448)``) is reduced on the device by
a small first kernel and finished inside the quantize kernel. In exchange nothing checks the
values: NaN/Inf in x or a non-positive global-scale *tensor* give unspecified codes, unless
``check_finite=True`` asks for the reference's checks (which synchronise).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from ..formats import NVFP4
from ..kernels.quantize import absmax_kernel, nvfp4_dequantize_kernel, nvfp4_fake_quantize_kernel, nvfp4_quantize_kernel
from ..quantize import FP4Tensor, quantize
from ..tuning import current_tuning
from ._runtime import arch_kwargs, device_arch, pdl_kwargs

__all__ = ["DequantizeConfig", "QuantizeConfig", "WeightDequantizeConfig", "dequantize_activations",
           "dequantize_weight", "fake_quantize_activations", "quantize_activations", "quantize_activations_reference"]

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK = NVFP4.block_size  # 16
_CHUNK = 2 * _BLOCK  # consecutive elements per thread: tiles are whole chunks (K may end mid-chunk: masked)
# The interpreter's tl.fma rounds twice; the kernel then emulates a fused multiply-add exactly.
_EMULATE_FMA = isinstance(nvfp4_quantize_kernel, InterpretedFunction)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class QuantizeConfig:
    """One program's tile: ``block_m`` rows x ``block_k`` columns of x, run by ``num_warps`` warps,
    compiled with at most ``maxnreg`` registers per thread (None: the compiler's choice)."""

    block_m: int
    block_k: int
    num_warps: int
    maxnreg: int | None = None

    def __post_init__(self) -> None:
        if not _is_pow2(self.block_m):
            raise ValueError(f"block_m: expected a power of two, got {self.block_m}")
        if not (_is_pow2(self.block_k) and self.block_k >= _CHUNK):
            raise ValueError(f"block_k: expected a power of two >= {_CHUNK} (the kernel's per-thread chunk), "
                             f"got {self.block_k}")
        if not (_is_pow2(self.num_warps) and self.num_warps <= 16):
            raise ValueError(f"num_warps: expected a power of two <= 16, got {self.num_warps}")
        if self.maxnreg is not None and not (isinstance(self.maxnreg, int) and 16 <= self.maxnreg <= 255):
            raise ValueError(f"maxnreg: expected None or an int in [16, 255], got {self.maxnreg!r}")

    def __str__(self) -> str:  # tables and guard keys: "quant_m1_k1024_w1" (+ "_r64" with a register cap)
        cap = f"_r{self.maxnreg}" if self.maxnreg is not None else ""
        return f"quant_m{self.block_m}_k{self.block_k}_w{self.num_warps}{cap}"

    @classmethod
    def from_heuristic(cls, M: int, K: int, dtype: torch.dtype = torch.bfloat16) -> QuantizeConfig:
        """1024 elements per program: one warp, 32 elements per thread, 64 registers at most for
        bf16 x (the compiler's choice for fp16 and fp32, which spill 28 and 564 bytes at 64 on SM90).

        One row of 1024 columns, or two rows of 512 when that wastes fewer columns past K (ties
        to the wider: K = 6144, 2048 and 7168 take 1024, 1536 and 2560 take 512, 2880 takes 1024:
        both widths cover 3072 columns); narrower x (K < 512) in tiles of up to 1024 elements.
        Why (the kernel is bound by instruction issue, not memory; docs/performance-engineering.md,
        ``QuantizeConfig.from_heuristic``):

        * 32 elements per thread: 64 per thread is register-limited, 16 per thread leaves half the
          lanes idle;
        * one warp: a program's check for blocks that need the per-element clamp is then a warp
          reduction, without shared memory and a barrier;
        * 64 registers (bf16): the kernel compiles to 72, which fits 28 one-warp programs per SM; at
          64 (16 B of spill stores and loads, in the path for global scales outside the fast
          range) the SM's limit of 32 resident programs binds instead.
        """
        block_k = min(1024, triton.next_power_of_2(max(K, _CHUNK)))
        if block_k >= 512:
            block_k = min((1024, 512), key=lambda w: (-(-K // w) * w - K, -w))
        block_m = min(triton.next_power_of_2(max(M, 1)), 1024 // block_k)
        return cls(block_m=block_m, block_k=block_k, num_warps=max(1, block_m * block_k // 1024),
                   maxnreg=64 if dtype == torch.bfloat16 else None)


def quantize_activations_reference(x: torch.Tensor, global_scale: torch.Tensor | float | None = None) -> FP4Tensor:
    """The numerics :func:`quantize_activations` reproduces: ``fp4moe.quantize(x, "nvfp4", global_scale)``."""
    return quantize(x, "nvfp4", global_scale)


def _given_global_scale(global_scale: torch.Tensor | float, device: torch.device, check: bool) -> torch.Tensor:
    """A given global scale as a 0-d fp32 tensor on ``device``; a tensor's value is checked only if ``check``."""
    if isinstance(global_scale, (int, float)) and not isinstance(global_scale, bool):
        value = torch.tensor(float(global_scale), dtype=torch.float32).item()  # what the reference rounds to
        if not 0 < value < math.inf:
            raise ValueError(f"global_scale: expected a positive finite fp32 value, got {global_scale!r}")
        return torch.full((), value, dtype=torch.float32, device=device)  # a fill: no host-device copy
    if not isinstance(global_scale, torch.Tensor):
        raise TypeError(f"global_scale: expected a float, a one-element tensor or None, "
                        f"got {type(global_scale).__name__}")
    if global_scale.numel() != 1:
        raise ValueError(f"global_scale: expected one value, got a tensor of shape {tuple(global_scale.shape)}")
    gs = global_scale.detach().to(device=device, dtype=torch.float32).reshape(())
    if check and not 0 < float(gs) < math.inf:
        raise ValueError(f"global_scale: expected a positive finite value, got {float(gs)}")
    return gs


def quantize_activations(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    *,
    check_finite: bool = False,
    config: QuantizeConfig | None = None,
) -> FP4Tensor:
    """Quantize activations ``x`` [..., K] to NVFP4 along K with Triton kernels.

    Args:
        x: bf16, fp16 or fp32 of any shape with K = ``x.shape[-1]`` a multiple of 16, on a CUDA
            device (or on the CPU under ``TRITON_INTERPRET=1``). Any strides: rows whose last
            dimension is not contiguous are copied first.
        global_scale: the fp32 per-tensor scale, as a float or a one-element tensor (read on the
            device); None computes ``amax(|x|) / (6 * 448)`` on the device (1.0 for all zeros).
        check_finite: refuse NaN/Inf in x and a non-positive or non-finite global-scale tensor,
            as ``fp4moe.quantize`` does. Off by default: the checks synchronise with the host.
        config: pin the tiling; default :meth:`QuantizeConfig.from_heuristic`.

    Returns:
        An :class:`FP4Tensor` of logical shape ``x.shape`` on x's device: data uint8 [..., K/2],
        scales float8_e4m3fn [..., K/16], global_scale a 0-d fp32 tensor.
    """
    x2, lead, gs, cfg = _prepare(x, global_scale, check_finite, config)
    M, K = x2.shape
    data = torch.empty((M, K // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((M, K // _BLOCK), dtype=torch.uint8, device=x.device)
    dynamic = gs is None
    if dynamic:  # written by the quantize kernel's first program; for empty x the reference's 1.0
        gs = (torch.empty if M and K else torch.ones)((), dtype=torch.float32, device=x.device)
    if M and K:
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            scale_in, n_part, launch = _scale_in(x2, None if dynamic else gs, cfg)
            nvfp4_quantize_kernel[_grid(M, K, cfg)](x2, data.view(torch.int32), scales, scale_in, gs, M, K, x2.stride(0),
                                                    n_part, DYNAMIC=dynamic, **launch, **arch_kwargs(x2.device))
    return FP4Tensor(
        data=data.reshape(*lead, K // 2),
        scales=scales.view(torch.float8_e4m3fn).reshape(*lead, K // _BLOCK),
        global_scale=gs,
        shape=x.shape,
        fmt=NVFP4,
    )


def fake_quantize_activations(x: torch.Tensor, global_scale: torch.Tensor | float | None = None,
                              weight_global_scale: torch.Tensor | None = None, *, k_stored: int | None = None,
                              config: QuantizeConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``dequantize_activations(quantize_activations(x, global_scale), weight_global_scale)`` in one
    kernel (``nvfp4_fake_quantize_kernel``), bit for bit: the W4A4 path of GPUs without FP4 MMA
    needs the NVFP4 activations only as bf16 values, so the codes need not go through memory.

    x: [M, K] as ``quantize_activations`` takes it (K a multiple of 16; bf16, fp16 or fp32).
    Returns ``(x_hat, g)``: x_hat [M, K] bf16 = e2m1(code) * e4m3(block scale), without the global
    scale; g fp32 = the activations' global scale (given, or amax(|x|) / 2688 computed on the
    device) times ``weight_global_scale`` (1..``MAX_WEIGHT_GLOBALS`` values, its shape), or [1]
    without it. Launched with PDL where the device has it, so the GEMM after it launches early.
    ``config`` pins the tile as for the quantizer; its register cap (``maxnreg``) is not applied:
    this kernel holds its chunk's 32 values too (72 registers, no spills, on SM90).

    ``k_stored``: x_hat [M, k_stored] in the packed weights' MMA K order instead (the wgmma kernel's
    input, ``dequantize_activations(k_stored=)``), which the quantizer and the dequantize kernel
    write: the permutation crosses the quantizer's per-thread chunks."""
    if k_stored is not None:
        return dequantize_activations(quantize_activations(x, global_scale, config=config), weight_global_scale,
                                      k_stored=k_stored)
    x2, lead, gs, cfg = _prepare(x, global_scale, False, config)
    if len(lead) != 1:
        raise ValueError(f"x: expected 2-D activations [M, K], got shape {tuple(x.shape)}")
    M, K = x2.shape
    wg = _check_weight_globals(weight_global_scale, x.device)
    out = torch.empty((M, K), dtype=torch.bfloat16, device=x.device)
    g = torch.empty((1,), dtype=torch.float32, device=x.device) if wg is None else torch.empty_like(wg)
    dynamic = gs is None
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        if M == 0 or K == 0:  # no tile to run: g from the given scale, or the reference's 1.0 for empty x
            g.copy_((gs if gs is not None else torch.ones((), device=x.device)) * (wg if wg is not None else 1.0))
            return out, g
        scale_in, n_part, launch = _scale_in(x2, gs, cfg)
        launch.pop("maxnreg", None)  # the 64-register cap is the quantize kernel's (its codes' registers)
        nvfp4_fake_quantize_kernel[_grid(M, K, cfg)](
            x2, out, scale_in, wg if wg is not None else scale_in, g, M, K, x2.stride(0), out.stride(0), g.numel(), n_part,
            DYNAMIC=dynamic, HAS_WG=wg is not None, BLOCK_G=triton.next_power_of_2(g.numel()),
            **launch, **pdl_kwargs(x.device), **arch_kwargs(x2.device))
    return out, g


def _prepare(x: torch.Tensor, global_scale: torch.Tensor | float | None, check_finite: bool,
             config: QuantizeConfig | None) -> tuple[torch.Tensor, list[int], torch.Tensor | None, QuantizeConfig]:
    """Checks of the quantizers' arguments; x as the kernels read it ([M, K], K contiguous, bf16 on
    4 bytes), x's leading shape, the given global scale as a device tensor (None: dynamic), the tile."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x: expected one of bfloat16, float16, float32, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x: expected at least one dimension [..., K], got a 0-d tensor")
    *lead, K = x.shape
    if K % _BLOCK:
        raise ValueError(f"x: expected the last dimension K to be a multiple of {_BLOCK}, "
                         f"got shape {tuple(x.shape)}")
    if config is not None and not isinstance(config, QuantizeConfig):
        raise TypeError(f"config: expected a QuantizeConfig or None, got {type(config).__name__}")
    gs = None if global_scale is None else _given_global_scale(global_scale, x.device, check_finite)
    if check_finite and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"x: expected finite values (check_finite=True), got {bad} NaN/Inf value(s)")
    M = math.prod(lead)
    x2 = x.reshape(M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.dtype == torch.bfloat16 and (x2.data_ptr() % 4 or (M > 1 and x2.stride(0) % 2)):
        x2 = x2.clone(memory_format=torch.contiguous_format)  # the kernel reads bf16 pairs as int32 words
    return x2, lead, gs, config or QuantizeConfig.from_heuristic(max(M, 1), K, x2.dtype)


def _grid(M: int, K: int, cfg: QuantizeConfig) -> tuple[int, int]:
    return triton.cdiv(M, cfg.block_m), triton.cdiv(K, cfg.block_k)


def absmax_partials(M: int, K: int, cfg: QuantizeConfig) -> int:
    """How many maxima ``absmax_kernel`` leaves for x [M, K] under ``cfg``: one per program (its grid)
    when that is at most ``QuantizeTuning.max_absmax_partials``, which the quantize kernels then reduce themselves
    (no zero-filled word, no atomics: one kernel fewer ahead of the quantizer, which matters at decode
    sizes); else 1, the atomic maximum of a zeroed word."""
    n = _absmax_programs(M, K, cfg)
    return n if n <= current_tuning().quantize.max_absmax_partials else 1


def _absmax_programs(M: int, K: int, cfg: QuantizeConfig) -> int:
    return triton.cdiv(M, cfg.block_m * current_tuning().quantize.absmax_row_steps) * triton.cdiv(K, cfg.block_k)


def _scale_in(x2: torch.Tensor, gs: torch.Tensor | None, cfg: QuantizeConfig) -> tuple[torch.Tensor, int, dict]:
    """What the quantize kernels read as their scale: the given global scale, or when gs is None
    amax(|x|) reduced now by ``absmax_kernel`` (launched with PDL where the device has it), as one
    word or as ``absmax_partials`` maxima; how many there are; the kernels' launch options for x2
    (M, K > 0), ``BLOCK_P`` included."""
    M, K = x2.shape
    tile = dict(BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    n_part = 1
    if gs is None:
        n_part = absmax_partials(M, K, cfg)
        tune = current_tuning().quantize
        partials = _absmax_programs(M, K, cfg) <= tune.max_absmax_partials
        amax_bits = (torch.empty if partials else torch.zeros)((n_part,), dtype=torch.int32, device=x2.device)
        absmax_grid = (triton.cdiv(M, cfg.block_m * tune.absmax_row_steps), triton.cdiv(K, cfg.block_k))
        absmax_kernel[absmax_grid](x2, amax_bits, M, K, x2.stride(0), ROW_STEPS=tune.absmax_row_steps, PARTIALS=partials,
                                   **tile, **pdl_kwargs(x2.device), **arch_kwargs(x2.device))
        gs = amax_bits.view(torch.float32)
    arch = device_arch(x2.device)
    # the register cap is a compile option (the interpreter has none)
    cap = {"maxnreg": cfg.maxnreg} if cfg.maxnreg is not None and not _EMULATE_FMA else {}
    return gs, n_part, dict(SM86=arch is not None and arch.has_xorsign_abs_max, EMULATE_FMA=_EMULATE_FMA,
                            BLOCK_P=triton.next_power_of_2(n_part), **tile, **cap)


def _check_weight_globals(wg: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    if wg is not None and not (1 <= wg.numel() <= MAX_WEIGHT_GLOBALS and wg.dtype == torch.float32
                               and wg.is_contiguous()):
        raise ValueError(f"weight_global_scale: expected 1..{MAX_WEIGHT_GLOBALS} contiguous fp32 values, got "
                         f"{wg.dtype} of shape {tuple(wg.shape)}")
    if wg is not None and wg.device != device:
        raise ValueError(f"weight_global_scale: expected device {device}, got {wg.device}")
    return wg


@dataclass(frozen=True)
class DequantizeConfig:
    """``nvfp4_dequantize_kernel``'s tile: ``block_k`` columns of one row by ``num_warps`` warps.
    The one the runtime uses (``DequantizeConfig()``): 1,024 columns, 4 warps, 8 elements per
    thread (one 16-byte bf16 store each)."""

    block_k: int = 1024
    num_warps: int = 4

    def __post_init__(self) -> None:
        _check_elementwise_tile("block_k", self.block_k, self.num_warps)

    def __str__(self) -> str:  # the plan's configuration column
        return f"dequant_k{self.block_k}_w{self.num_warps}"


def _check_elementwise_tile(name: str, size: int, num_warps: int) -> None:
    """An elementwise kernel's tile: ``size`` (a power of two) elements over ``num_warps`` warps."""
    if not (_is_pow2(size) and size >= 32 * num_warps):
        raise ValueError(f"{name}: expected a power of two >= 32 * num_warps, got {size}")
    if not (_is_pow2(num_warps) and num_warps <= 16):
        raise ValueError(f"num_warps: expected a power of two <= 16, got {num_warps}")


#: the most weight global scales the dequantize kernel's first program multiplies (per-expert globals)
MAX_WEIGHT_GLOBALS = 1024


@dataclass(frozen=True)
class WeightDequantizeConfig:
    """Launch parameters of ``nvfp4_weight_dequantize_kernel``: ``block`` bytes of codes per program
    (2 ``block`` output values), ``num_warps``."""

    block: int = 2048
    num_warps: int = 4

    def __post_init__(self) -> None:
        _check_elementwise_tile("block", self.block, self.num_warps)

    def __str__(self) -> str:  # the plan's configuration column: what follows the kernel is torch's
        return f"dequant_block{self.block}_w{self.num_warps} + torch.matmul"


def dequantize_weight(w: FP4Tensor, config: WeightDequantizeConfig = WeightDequantizeConfig()) -> torch.Tensor:
    """A 2-D NVFP4 weight [N, K] to bf16 ``e2m1(code) * e4m3(block scale)`` (exact in bf16), without
    its global scale: ``ops.linear``'s large-batch path multiplies the GEMM's fp32 sums by that. One
    pass over contiguous codes and scales (``nvfp4_weight_dequantize_kernel``); other strides go
    through ``dequantize_activations``. Equals ``dequantize_activations``' values bit for bit."""
    from ..kernels.quantize import nvfp4_weight_dequantize_kernel

    if not isinstance(w, FP4Tensor) or w.fmt is not NVFP4 or w.data.dim() != 2:
        raise TypeError("w: expected a 2-D NVFP4 FP4Tensor")
    N, K = w.shape
    if not (w.data.is_contiguous() and w.scales.is_contiguous()):
        ones = torch.ones(1, dtype=torch.float32, device=w.device)
        return dequantize_activations(FP4Tensor(w.data, w.scales, ones, w.shape, w.fmt))[0]
    out = torch.empty((N, K), dtype=torch.bfloat16, device=w.device)
    n_bytes = N * K // 2
    if n_bytes == 0:
        return out
    with torch.cuda.device(w.device) if w.data.is_cuda else contextlib.nullcontext():
        nvfp4_weight_dequantize_kernel[(triton.cdiv(n_bytes, config.block),)](
            w.data, w.scales.view(torch.uint8), out.view(torch.int32), n_bytes, BLOCK=config.block,
            num_warps=config.num_warps,
            **pdl_kwargs(w.device), **arch_kwargs(out.device))
    return out


def dequantize_activations(xq: FP4Tensor, weight_global_scale: torch.Tensor | None = None, *,
                           k_stored: int | None = None,
                           config: DequantizeConfig = DequantizeConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 activations ``xq`` [M, K] (``quantize_activations``' result) back to bf16 for the
    W4A4 path of GPUs without FP4 MMA (one Triton kernel, ``nvfp4_dequantize_kernel``).

    Returns ``(x_hat, g)``: x_hat [M, K] bf16 holds ``e2m1(code) * e4m3(block scale)``, exact in
    bf16, *without* the global scale; ``g`` fp32 is ``xq.global_scale * weight_global_scale``
    (shaped as the weight's globals: one, or one per expert, up to ``MAX_WEIGHT_GLOBALS``), or [1]
    ``xq.global_scale`` without it, for the GEMM to apply once to its fp32 sums. ``dequantize(xq)`` equals
    ``x_hat.float() * xq.global_scale`` up to the rounding of that last product.

    ``k_stored`` (a multiple of 64, >= K): x_hat is [M, k_stored] in the packed weights' MMA K
    order instead, zeros past K, what ``ops.wgmma.mma_order_rows`` makes of the plain result:
    the wgmma kernel's input, without that second pass."""
    if not isinstance(xq, FP4Tensor) or xq.fmt is not NVFP4:
        raise TypeError(f"xq: expected an NVFP4 FP4Tensor, got {type(xq).__name__}"
                        + (f" in {xq.fmt}" if isinstance(xq, FP4Tensor) else ""))
    if xq.data.dim() != 2 or xq.global_scale is None or xq.global_scale.numel() != 1:
        raise ValueError(f"xq: expected 2-D activations [M, K] with one global scale, got data "
                         f"{tuple(xq.data.shape)}")
    M, K = xq.shape
    if k_stored is not None and (k_stored % 64 or k_stored < K):
        raise ValueError(f"k_stored: expected a multiple of 64 >= K = {K}, got {k_stored}")
    k_out = K if k_stored is None else k_stored
    out = torch.empty((M, k_out), dtype=torch.bfloat16, device=xq.device)
    data, scales = xq.data, xq.scales.view(torch.uint8)
    if data.stride(-1) != 1 or scales.stride(-1) != 1:
        raise ValueError("xq: packed codes and scales must be contiguous along K")
    wg = _check_weight_globals(weight_global_scale, xq.device)
    g = torch.empty((1,), dtype=torch.float32, device=xq.device) if wg is None else torch.empty_like(wg)
    grid = (max(1, M), max(1, triton.cdiv(k_out, config.block_k)))
    with torch.cuda.device(xq.device) if xq.data.is_cuda else contextlib.nullcontext():
        nvfp4_dequantize_kernel[grid](
            data, scales, xq.global_scale, wg if wg is not None else xq.global_scale, out, g, M, K, k_out,
            data.stride(0), scales.stride(0), out.stride(0), g.numel(), BLOCK_K=config.block_k,
            HAS_WG=wg is not None, BLOCK_G=triton.next_power_of_2(g.numel()), MMA_ORDER=k_stored is not None,
            num_warps=config.num_warps, **pdl_kwargs(xq.device), **arch_kwargs(out.device))
    return out, g
