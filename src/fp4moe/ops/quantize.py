"""NVFP4 activation quantization on the GPU (Triton), bit-identical to ``fp4moe.quantize``.

``quantize_activations(x, global_scale)`` equals ``quantize_activations_reference(x, global_scale)``
(= ``fp4moe.quantize(x, "nvfp4", global_scale)``) bit for bit: same packed codes, same E4M3
block-scale bits, same global scale.

The hot path never synchronises with the host: a given global scale is read by the kernel
from device memory, and the dynamic one (``amax(|x|) / (6 * 448)``) is reduced on the device by
a first small kernel and finished inside the quantize kernel. The price is that, unlike the
reference, nothing checks the data: NaN/Inf in ``x`` or a non-positive global-scale *tensor*
give unspecified codes unless ``check_finite=True``, which checks both (and synchronises).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from ..formats import NVFP4
from ..quantize import FP4Tensor, quantize
from ..kernels.quantize import absmax_kernel, nvfp4_quantize_kernel

__all__ = ["QuantizeConfig", "quantize_activations", "quantize_activations_reference"]

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK = NVFP4.block_size  # 16
# The interpreter's tl.fma rounds twice; the kernel then emulates a fused multiply-add exactly.
_EMULATE_FMA = isinstance(nvfp4_quantize_kernel, InterpretedFunction)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class QuantizeConfig:
    """Tile of one program: ``block_m`` rows x ``block_k`` columns of x, ``num_warps`` warps."""

    block_m: int
    block_k: int
    num_warps: int

    def __post_init__(self) -> None:
        if not _is_pow2(self.block_m):
            raise ValueError(f"block_m: expected a power of two, got {self.block_m}")
        if not (_is_pow2(self.block_k) and self.block_k >= _BLOCK):
            raise ValueError(f"block_k: expected a power of two >= {_BLOCK}, got {self.block_k}")
        if not (_is_pow2(self.num_warps) and self.num_warps <= 32):
            raise ValueError(f"num_warps: expected a power of two <= 32, got {self.num_warps}")

    @classmethod
    def from_heuristic(cls, M: int, K: int) -> QuantizeConfig:
        """Up to 8192 elements per program (16 KB of bf16: 8 loads of 16 bytes in flight per thread
        at 4 warps), at most 512 columns wide so that wide rows still give several programs."""
        block_k = min(512, triton.next_power_of_2(max(K, _BLOCK)))
        block_m = min(triton.next_power_of_2(max(M, 1)), max(1, 8192 // block_k))
        num_warps = max(1, min(4, block_m * block_k // 512))
        return cls(block_m=block_m, block_k=block_k, num_warps=num_warps)


def quantize_activations_reference(x: torch.Tensor, global_scale: torch.Tensor | float | None = None) -> FP4Tensor:
    """The numerics :func:`quantize_activations` must reproduce: ``fp4moe.quantize(x, "nvfp4", global_scale)``."""
    return quantize(x, "nvfp4", global_scale)


def _global_scale(global_scale: torch.Tensor | float | None, device: torch.device,
                  check: bool) -> torch.Tensor | None:
    """A given global scale as a 0-d fp32 tensor on ``device`` (no host sync unless ``check``)."""
    if global_scale is None:
        return None
    if isinstance(global_scale, (int, float)) and not isinstance(global_scale, bool):
        value = torch.tensor(float(global_scale), dtype=torch.float32).item()  # rounded to fp32 first
        if not 0 < value < float("inf"):
            raise ValueError(f"global_scale: expected a positive finite fp32 value, got {global_scale}")
        return torch.full((), value, dtype=torch.float32, device=device)
    if not isinstance(global_scale, torch.Tensor):
        raise TypeError(f"global_scale: expected a float, a one-element tensor or None, "
                        f"got {type(global_scale).__name__}")
    if global_scale.numel() != 1:
        raise ValueError(f"global_scale: expected one value, got a tensor of shape {tuple(global_scale.shape)}")
    gs = global_scale.detach().to(device=device, dtype=torch.float32).reshape(())
    if check and not 0 < float(gs) < float("inf"):
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
        x: bf16, fp16 or fp32, any shape with K = ``x.shape[-1]`` a multiple of 16, on a CUDA
            device (or on the CPU under ``TRITON_INTERPRET=1``). Any layout; rows need a
            contiguous last dimension, otherwise x is copied first.
        global_scale: fp32 per-tensor scale, a float or a one-element tensor (read on the device);
            None computes ``amax(|x|) / (6 * 448)`` (1.0 when x is all zeros) on the device.
        check_finite: refuse NaN/Inf in x and a non-positive or non-finite global-scale tensor
            (as ``fp4moe.quantize`` does). Off by default because it synchronises with the host.
        config: pin the tile shape; default :meth:`QuantizeConfig.from_heuristic`.

    Returns:
        An :class:`FP4Tensor` of logical shape ``x.shape``: data uint8 [..., K/2], scales
        float8_e4m3fn [..., K/16], global_scale a 0-d fp32 tensor, all on ``x.device``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x: expected one of bfloat16, float16, float32, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x: expected at least one dimension [..., K], got a 0-d tensor")
    *lead, K = x.shape
    if K % _BLOCK:
        raise ValueError(f"x: the last dimension K={K} must be a multiple of {_BLOCK}, got shape {tuple(x.shape)}")
    if config is not None and not isinstance(config, QuantizeConfig):
        raise TypeError(f"config: expected a QuantizeConfig or None, got {type(config).__name__}")
    gs = _global_scale(global_scale, x.device, check_finite)
    if check_finite and x.numel() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"x: expected finite values (check_finite=True), got {bad} NaN/Inf value(s)")

    M = math.prod(lead)
    x2 = x.reshape(M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    data = torch.empty((M, K // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((M, K // _BLOCK), dtype=torch.uint8, device=x.device)
    if M == 0 or K == 0:
        gs = torch.ones((), dtype=torch.float32, device=x.device) if gs is None else gs
    else:
        cfg = config or QuantizeConfig.from_heuristic(M, K)
        grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(K, cfg.block_k))
        tile = dict(BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
        on_device = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
        with on_device:
            dynamic = gs is None
            if dynamic:
                amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
                absmax_kernel[grid](x2, amax_bits, M, K, x2.stride(0), **tile)
                scale_in, gs = amax_bits.view(torch.float32), torch.empty((), dtype=torch.float32, device=x.device)
            else:
                scale_in = gs
            nvfp4_quantize_kernel[grid](x2, data.view(torch.int32), scales, scale_in, gs, M, K, x2.stride(0),
                                        DYNAMIC=dynamic, EMULATE_FMA=_EMULATE_FMA, **tile)
    return FP4Tensor(
        data=data.reshape(*lead, K // 2),
        scales=scales.view(torch.float8_e4m3fn).reshape(*lead, K // _BLOCK),
        global_scale=gs,
        shape=x.shape,
        fmt=NVFP4,
    )
