"""The torch reference for FP4 quantization: ``quantize``, ``dequantize`` and ``FP4Tensor``.

This is the definition of the numerics (REFERENCE.md). Kernels that quantize (the activation
quantizer of the W4A4 path) are tested bit-exactly against :func:`quantize`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

from .formats import (
    E2M1_MAX,
    E4M3_MAX,
    FP4Format,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    get_format,
    mxfp4_block_exponents,
    nvfp4_block_scales,
    pack_fp4,
    swizzle_scales,
    unpack_fp4,
)

__all__ = ["FP4Tensor", "quantize", "quantize_stacked", "dequantize", "nvfp4_global_scale"]

_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FP4Tensor:
    """A tensor quantized to an FP4 block format along its last (K) axis.

    Attributes:
        data: uint8 [..., K/2], two E2M1 codes per byte, the even element in the low nibble.
        scales: [..., K/block] row-major; float8_e4m3fn (NVFP4) or uint8 E8M0 exponents (MXFP4).
        global_scale: NVFP4: fp32 with one element, or with one dimension per leading dimension
            that broadcasts to ``shape[:-1]``: [E, 1] (per expert) or [E, N] (per row) for stacked
            expert weights [E, N, K], whose experts (and gate/up halves) carry their own; MXFP4: None.
        shape: the logical shape [..., K].
        fmt: the format.
    """

    data: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None
    shape: torch.Size
    fmt: FP4Format

    def __post_init__(self) -> None:
        fmt = get_format(self.fmt)
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "shape", torch.Size(self.shape))
        *lead, k = self.shape if len(self.shape) else (0,)
        if self.data.dtype != torch.uint8:
            raise TypeError(f"data: expected uint8 packed codes, got {self.data.dtype}")
        if k % fmt.block_size:
            raise ValueError(f"shape: K={k} must be a multiple of the {fmt} block size {fmt.block_size}")
        if tuple(self.data.shape) != (*lead, k // 2):
            raise ValueError(f"data: expected shape {(*lead, k // 2)} for logical shape {tuple(self.shape)}, "
                             f"got {tuple(self.data.shape)}")
        if self.scales.dtype != fmt.scale_dtype:
            raise TypeError(f"scales: expected {fmt.scale_dtype} for {fmt}, got {self.scales.dtype}")
        if tuple(self.scales.shape) != (*lead, k // fmt.block_size):
            raise ValueError(f"scales: expected shape {(*lead, k // fmt.block_size)} for logical shape "
                             f"{tuple(self.shape)}, got {tuple(self.scales.shape)}")
        if fmt.has_global_scale:
            if self.global_scale is None:
                raise ValueError(f"global_scale: {fmt} needs an fp32 global scale, got None")
            if self.global_scale.dtype != torch.float32:
                raise TypeError(f"global_scale: expected float32, got {self.global_scale.dtype}")
            gs_shape = tuple(self.global_scale.shape)
            broadcasts = len(gs_shape) == len(lead) and all(g in (1, n) for g, n in zip(gs_shape, lead))
            if self.global_scale.numel() != 1 and not broadcasts:
                raise ValueError(f"global_scale: expected one value, or one dimension per leading dimension of "
                                 f"{tuple(self.shape)} broadcasting to {tuple(lead)} (e.g. [E, 1] per expert, "
                                 f"[E, N] per row), got shape {gs_shape}")
        elif self.global_scale is not None:
            raise ValueError(f"global_scale: {fmt} has no global scale, got a tensor")

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def block_size(self) -> int:
        return self.fmt.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of packed data plus block scales (what a kernel must read)."""
        return self.data.numel() + self.scales.numel()

    def to(self, device: torch.device | str) -> FP4Tensor:
        gs = None if self.global_scale is None else self.global_scale.to(device)
        return replace(self, data=self.data.to(device), scales=self.scales.to(device), global_scale=gs)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self, dtype)

    def swizzled_scales(self) -> torch.Tensor:
        """Block scales in the 128x4 layout of CUTLASS/cuBLASLt (see ``formats.swizzle_scales``)."""
        if len(self.shape) < 2:
            raise ValueError(f"swizzled_scales: needs a matrix, this tensor has shape {tuple(self.shape)}")
        return swizzle_scales(self.scales)

    def block_scales_fp32(self) -> torch.Tensor:
        """The block scales decoded to fp32 (without the global scale)."""
        if self.fmt.scale_kind == "e4m3":
            return self.scales.to(torch.float32)
        return e8m0_decode(self.scales)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's NVFP4 global scale ``amax / (6 * 448)``; 1.0 when amax is 0 (all-zero tensor).

    The divisor is a tensor on amax's device: torch on CUDA turns division by a Python number
    into a multiplication by its reciprocal, which rounds differently for ~22% of inputs; a
    tensor divisor is a correctly rounded division on every device.
    """
    amax = amax.to(torch.float32)
    divisor = torch.tensor(E2M1_MAX * E4M3_MAX, dtype=torch.float32, device=amax.device)
    return torch.where(amax > 0, amax / divisor, torch.ones_like(amax))


def _check_global_scale(global_scale: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    if isinstance(global_scale, (int, float)):
        gs = torch.tensor(float(global_scale), dtype=torch.float32, device=device)
    elif isinstance(global_scale, torch.Tensor):
        if global_scale.numel() != 1:
            raise ValueError(f"global_scale: expected one value, got a tensor of shape {tuple(global_scale.shape)}")
        gs = global_scale.detach().to(device=device, dtype=torch.float32).reshape(())
    else:
        raise TypeError(f"global_scale: expected a float, a one-element tensor or None, "
                        f"got {type(global_scale).__name__}")
    value = float(gs)
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"global_scale: expected a positive finite value, got {value}")
    return gs


def quantize(
    x: torch.Tensor,
    fmt: str | FP4Format = "nvfp4",
    global_scale: torch.Tensor | float | None = None,
    axis: int = -1,
    nonfinite: Literal["raise", "zero"] = "raise",
) -> FP4Tensor:
    """Quantize ``x`` to an FP4 format with blocks along ``axis``.

    Args:
        x: float32, float16 or bfloat16 tensor, any shape; ``x.shape[axis]`` must be a multiple
            of the block size (16 for NVFP4, 32 for MXFP4). Non-contiguous input is fine.
        fmt: "nvfp4" or "mxfp4" (or an FP4Format).
        global_scale: NVFP4 only. None means the ModelOpt convention ``amax(x) / (6 * 448)``.
            A given scale may make block scales exceed 448; they then saturate at 448.
        axis: the block (reduction) axis. The result is laid out with that axis last:
            ``quantize(w, axis=0)`` of a [K, N] matrix returns an FP4Tensor of logical shape [N, K].
        nonfinite: "raise" (default) refuses NaN/Inf; "zero" maps them to 0 before quantizing.

    Returns:
        An :class:`FP4Tensor`.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"x: expected one of float32, float16, bfloat16, got {x.dtype}")
    fmt = get_format(fmt)
    if x.dim() == 0:
        raise ValueError("x: expected at least one dimension (the block axis), got a 0-d tensor")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis: expected a dimension of x (ndim {x.dim()}), got {axis}")
    if nonfinite not in ("raise", "zero"):
        raise ValueError(f"nonfinite: expected 'raise' or 'zero', got {nonfinite!r}")
    if global_scale is not None and not fmt.has_global_scale:
        raise ValueError(f"global_scale: {fmt} has no global scale; pass None")

    xf = x.movedim(axis, -1).to(torch.float32)
    *lead, k = xf.shape
    bs = fmt.block_size
    if k % bs:
        raise ValueError(f"x: the block axis (axis={axis}) has length {k}, which is not a multiple of "
                         f"the {fmt} block size {bs}")
    finite = torch.isfinite(xf)
    if not bool(finite.all()):
        if nonfinite == "raise":
            bad = (~finite).sum().item()
            raise ValueError(f"x: contains {bad} NaN/Inf value(s); pass nonfinite='zero' to map them to 0")
        xf = torch.where(finite, xf, torch.zeros_like(xf))

    blocks = xf.reshape(*lead, k // bs, bs)
    block_amax = blocks.abs().amax(dim=-1) if blocks.numel() else blocks.new_zeros(blocks.shape[:-1])
    if fmt.has_global_scale:
        if global_scale is None:
            amax = xf.abs().amax() if xf.numel() else xf.new_zeros(())
            gs = nvfp4_global_scale(amax)
        else:
            gs = _check_global_scale(global_scale, x.device)
        scales = nvfp4_block_scales(block_amax, gs)
        denom = scales.to(torch.float32) * gs
        scaled = blocks / denom.unsqueeze(-1)
    else:
        gs = None
        scales = mxfp4_block_exponents(block_amax)
        exponent = scales.to(torch.int32) - 127
        scaled = torch.ldexp(blocks, -exponent.unsqueeze(-1))  # exact: a power-of-two division
    codes = e2m1_encode(scaled.reshape(*lead, k))
    return FP4Tensor(data=pack_fp4(codes), scales=scales, global_scale=gs, shape=torch.Size((*lead, k)), fmt=fmt)


def dequantize(t: FP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode an :class:`FP4Tensor`: ``e2m1(q) * fp32(block_scale) [* global]``, cast to ``dtype``."""
    if not isinstance(t, FP4Tensor):
        raise TypeError(f"t: expected an FP4Tensor, got {type(t).__name__}")
    if dtype not in _FLOAT_INPUTS:
        raise TypeError(f"dtype: expected one of float32, float16, bfloat16, got {dtype}")
    *lead, k = t.shape
    bs = t.block_size
    values = e2m1_decode(unpack_fp4(t.data)).reshape(*lead, k // bs, bs)
    out = values * t.block_scales_fp32().unsqueeze(-1)
    if t.global_scale is not None:
        g = t.global_scale
        # one value, or one per leading index (per expert [E, 1], per row [E, N]): broadcast over the blocks
        out = out * (g.reshape(*g.shape, 1, 1) if g.numel() != 1 else g.reshape(()))
    return out.reshape(t.shape).to(dtype)


def quantize_stacked(w: torch.Tensor, fmt: str | FP4Format = "nvfp4", *, name: str = "w") -> FP4Tensor:
    """Quantize stacked matrices [E, N, K] (expert weights) each with its own global scale ([E, 1]):
    element for element what ``quantize(w[e])`` gives for each e. ``name`` is the tensor's in errors."""
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise ValueError(f"{name}: expected stacked matrices [E, N, K], got {getattr(w, 'shape', type(w).__name__)}")
    if w.shape[0] == 0:
        raise ValueError(f"{name}: expected at least one matrix (E >= 1), got shape {tuple(w.shape)}")
    w = w.detach()
    parts = [quantize(w[e], fmt) for e in range(w.shape[0])]
    fmt = get_format(fmt)
    gs = torch.stack([p.global_scale.reshape(1) for p in parts]) if fmt.has_global_scale else None
    return FP4Tensor(data=torch.stack([p.data for p in parts]), scales=torch.stack([p.scales for p in parts]),
                     global_scale=gs, shape=torch.Size(w.shape), fmt=fmt)
