"""FP4 formats as data: E2M1 elements, E4M3 / E8M0 block scales, packing and the 128x4 swizzle.

Everything here is plain PyTorch and defines the numerics that every kernel is tested
against (see REFERENCE.md in the design notes):

* E2M1 code ``s e1 e0 m``: bit 3 is the sign, bits 2..0 index the magnitudes
  0, 0.5, 1, 1.5, 2, 3, 4, 6. Rounding is to nearest, ties to the even code, saturating at 6.
* Two codes per byte along the block (reduction) axis: the element with the even index in the
  low nibble, the odd one in the high nibble.
* NVFP4: one E4M3 scale per 16 elements and an FP32 per-tensor global scale.
* MXFP4: one E8M0 scale (a biased power-of-two exponent) per 32 elements, no global scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "e4m3_to_e5m3",
    "invalid_scale_codes",
    "e5m3_to_e4m3",
    "FP4Format",
    "NVFP4",
    "MXFP4",
    "FORMATS",
    "get_format",
    "E2M1_VALUES",
    "E2M1_MAX",
    "E4M3_MAX",
    "E4M3_MIN_SCALE",
    "e2m1_encode",
    "e2m1_decode",
    "e4m3_decode_bits",
    "e4m3_is_nan",
    "e8m0_decode",
    "nvfp4_block_scales",
    "mxfp4_block_exponents",
    "pack_fp4",
    "unpack_fp4",
    "swizzle_scales",
    "unswizzle_scales",
    "swizzled_offset",
]


@dataclass(frozen=True)
class FP4Format:
    """An FP4 block format: E2M1 elements, one scale per ``block_size`` elements along K."""

    name: str
    block_size: int
    scale_kind: Literal["e4m3", "e8m0"]
    has_global_scale: bool

    @property
    def scale_dtype(self) -> torch.dtype:
        """How the block scales are stored: float8_e4m3fn (NVFP4) or uint8 exponents (MXFP4)."""
        return torch.float8_e4m3fn if self.scale_kind == "e4m3" else torch.uint8

    @property
    def bits_per_element(self) -> float:
        """Storage cost of one element including its share of the block scale (4 + 8/block)."""
        return 4.0 + 8.0 / self.block_size

    def __str__(self) -> str:  # shows up in error messages and tables
        return self.name

    def __reduce__(self):
        # copies and unpickled formats are the registered objects: code compares formats with ``is``
        if FORMATS.get(self.name) == self:
            return get_format, (self.name,)
        return FP4Format, (self.name, self.block_size, self.scale_kind, self.has_global_scale)


NVFP4 = FP4Format(name="nvfp4", block_size=16, scale_kind="e4m3", has_global_scale=True)
MXFP4 = FP4Format(name="mxfp4", block_size=32, scale_kind="e8m0", has_global_scale=False)
FORMATS: dict[str, FP4Format] = {NVFP4.name: NVFP4, MXFP4.name: MXFP4}


def get_format(fmt: str | FP4Format) -> FP4Format:
    """Return the format named ``fmt`` ("nvfp4" or "mxfp4", any case) or ``fmt`` itself (the
    registered object where ``fmt`` equals one: formats are compared with ``is``)."""
    if isinstance(fmt, FP4Format):
        return fmt if FORMATS.get(fmt.name) != fmt else FORMATS[fmt.name]
    if not isinstance(fmt, str):
        raise TypeError(f"fmt: expected 'nvfp4', 'mxfp4' or an FP4Format, got {type(fmt).__name__}")
    try:
        return FORMATS[fmt.lower()]
    except KeyError:
        raise ValueError(f"fmt: expected one of {sorted(FORMATS)}, got {fmt!r}") from None


# ----------------------------------------------------------------------------------------------
# E2M1 elements

#: Value of each of the 16 codes (code 8 is -0.0).
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0

# Rounding thresholds between neighbouring magnitudes. At a midpoint the even code wins:
# 0.25 -> 0 (code 0), 0.75 -> 1 (code 2), 1.25 -> 1 (code 2), 1.75 -> 2 (code 4),
# 2.5 -> 2 (code 4), 3.5 -> 4 (code 6), 5 -> 4 (code 6). ``strict`` means the midpoint itself
# rounds down (the lower neighbour has the even code), otherwise it rounds up.
_E2M1_THRESHOLDS: tuple[tuple[float, bool], ...] = (
    (0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False), (5.0, True),
)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already divided by their scale) to E2M1 codes (uint8 in 0..15).

    Round to nearest, ties to the even code, saturating at +-6. The sign bit is kept for
    values that round to zero (-0.1 -> code 8, i.e. -0), as the PTX ``cvt.rn.satfinite``
    conversion does. NaN is not accepted here: callers reject or map it first.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"x: expected float32 values, got {x.dtype}")
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for threshold, strict in _E2M1_THRESHOLDS:
        passed = a > threshold if strict else a >= threshold
        code += passed.to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits used) to their fp32 values."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes: expected uint8, got {codes.dtype}")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[(codes & 0xF).long()]


# ----------------------------------------------------------------------------------------------
# Scales

E4M3_MAX = 448.0
#: Smallest positive E4M3 value (a subnormal); NVFP4 block scales are clamped below to it.
E4M3_MIN_SCALE = 2.0**-9


def e4m3_decode_bits(bits: torch.Tensor) -> torch.Tensor:
    """Decode E4M3 (``float8_e4m3fn``) bit patterns held in uint8 to fp32 with integer math only.

    This is the arithmetic the kernels do in registers (they cannot rely on a hardware fp8
    conversion on every architecture); tests compare it with ``torch.float8_e4m3fn`` for all
    256 patterns. 0x7F and 0xFF are NaN.
    """
    if bits.dtype != torch.uint8:
        raise TypeError(f"bits: expected uint8, got {bits.dtype}")
    b = bits.to(torch.int32)
    sign = torch.where((b & 0x80) != 0, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).to(torch.float32)
    normal = (1.0 + man / 8.0) * torch.exp2((exp - 7).to(torch.float32))
    subnormal = man * 2.0**-9
    value = sign * torch.where(exp == 0, subnormal, normal)
    return torch.where(e4m3_is_nan(bits), torch.full_like(value, math.nan), value)


def e4m3_is_nan(bits: torch.Tensor) -> torch.Tensor:
    """Which E4M3 bit patterns (uint8) are NaN: 0x7F and 0xFF (``float8_e4m3fn`` has no infinity)."""
    return (bits & 0x7F) == 0x7F


def invalid_scale_codes(bits: torch.Tensor, scale_kind: str) -> torch.Tensor:
    """Which stored block-scale codes (uint8) no FP4 weight may hold: for E4M3 (NVFP4) the NaN
    codes 0x7F, 0xFF and the negative ones (sign bit set; -0 = 0x80 is a zero scale), for E8M0
    (MXFP4) the NaN code 0xFF. The kernels decode such codes as numbers ``dequantize`` does not
    (an E4M3 NaN as 480, a negative scale without its sign)."""
    if scale_kind == "e4m3":
        return e4m3_is_nan(bits) | (bits > 0x80)
    if scale_kind == "e8m0":
        return bits == 0xFF
    raise ValueError(f"scale_kind: expected 'e4m3' or 'e8m0', got {scale_kind!r}")


def e4m3_to_e5m3(bits: torch.Tensor) -> torch.Tensor:
    """E4M3 bit patterns (positive) -> E5M3 codes with exponent bias -10 (0 for a zero scale).

    Every E4M3 value, subnormals included, is a normal E5M3 number with exponent code 1..18, so a
    kernel turns a code into the bf16 bit pattern of ``scale * 2**118`` with one integer
    multiply-add: ``(code << 4) + (235 << 7)`` (``kernels.linear_mma``). Sign bits are ignored.
    """
    b = bits.to(torch.int32) & 0x7F
    e, m = b >> 3, b & 7
    normal = ((e + 3) << 3) | m
    # subnormal m/8 * 2**-6: normalise (m = 1: 2**-9, 2..3: 2**-8, 4..7: 2**-7)
    shift = torch.where(m >= 4, 2, torch.where(m >= 2, 1, 0))
    mant = ((m << (3 - shift)) & 7)
    sub = ((shift + 1) << 3) | mant
    return torch.where(e > 0, normal, torch.where(m > 0, sub, 0)).to(torch.uint8)


def e5m3_to_e4m3(code: torch.Tensor) -> torch.Tensor:
    """The inverse of ``e4m3_to_e5m3`` on codes of non-zero scales (uint8 E4M3 bits)."""
    c = code.to(torch.int32)
    e5, m = c >> 3, c & 7
    normal = ((e5 - 3) << 3) | m
    # e5 1..3 are the subnormals: value (8 + m) / 8 * 2**(e5 - 10) = m' / 8 * 2**-6
    mp = (8 + m) >> (4 - e5).clamp(min=0, max=4)
    return torch.where(e5 >= 4, normal, mp).to(torch.uint8)


def e8m0_decode(exponents: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (uint8 biased exponents) to fp32: 2**(e - 127); 255 is NaN."""
    if exponents.dtype != torch.uint8:
        raise TypeError(f"exponents: expected uint8, got {exponents.dtype}")
    e = exponents.to(torch.int32)
    value = torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), e - 127)
    return torch.where(e == 255, torch.full_like(value, math.nan), value)


def nvfp4_block_scales(block_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales for NVFP4 (ModelOpt convention).

    ``scale = e4m3(clamp(amax_block / (6 * global), 2**-9, 448))``; a block whose amax is zero
    gets 1.0. All arithmetic is fp32 with the same operation order the kernels use.
    """
    six_g = global_scale.to(torch.float32) * E2M1_MAX
    raw = block_amax.to(torch.float32) / six_g
    raw = raw.clamp(min=E4M3_MIN_SCALE, max=E4M3_MAX)
    raw = torch.where(block_amax == 0, torch.ones_like(raw), raw)
    return raw.to(torch.float8_e4m3fn)


def mxfp4_block_exponents(block_amax: torch.Tensor) -> torch.Tensor:
    """E8M0 block scales for MXFP4: the smallest power of two ``2**s`` with ``amax <= 6 * 2**s``.

    Rounding the shared exponent up means no element ever saturates (the OCP MX v1.0 rule
    ``floor(log2(amax)) - 2`` lets the top quarter of a binade clip to 6; triton_kernels'
    default MXFP4 downcast also rounds up). Computed exactly from ``frexp``: with
    ``amax = m * 2**e`` (m in [0.5, 1)), ``s = e - 3`` when ``m <= 0.75`` else ``e - 2``.
    Zero blocks get exponent 127 (scale 1.0). Biased exponents are clamped to [0, 254].
    """
    a = block_amax.to(torch.float32)
    mantissa, exponent = torch.frexp(a)
    s = exponent.to(torch.int32) - 3 + (mantissa > 0.75).to(torch.int32)
    biased = torch.where(a == 0, torch.full_like(s, 127), (s + 127).clamp(0, 254))
    return biased.to(torch.uint8)


# ----------------------------------------------------------------------------------------------
# Packing


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes [..., K] (uint8 0..15) into bytes [..., K/2]: even index in the low nibble."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes: expected uint8, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: the last dimension must be even to pack, got {tuple(codes.shape)}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: bytes [..., K/2] to codes [..., K]."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed: expected uint8, got {packed.dtype}")
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ----------------------------------------------------------------------------------------------
# 128x4 scale swizzle (CUTLASS / cuBLASLt / FlashInfer)


def _padded(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // 128) * 128, -(-cols // 4) * 4


def swizzled_offset(m: int, k: int, cols: int) -> int:
    """Flat offset of scale (m, k) in the 128x4 layout of a matrix with ``cols`` scale columns."""
    k_tiles = -(-cols // 4)
    return ((m // 128) * k_tiles + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Rearrange row-major block scales [..., rows, cols] into the 128x4 tiled layout.

    Rows are padded to a multiple of 128 and columns to a multiple of 4 (with zeros). The
    result has shape [..., rows_padded, cols_padded]; its *memory order* is the swizzled one,
    so scale (m, k) sits at flat offset :func:`swizzled_offset` within its matrix.
    """
    if scales.dim() < 2:
        raise ValueError(f"scales: expected at least 2 dimensions [rows, cols], got {tuple(scales.shape)}")
    *lead, rows, cols = scales.shape
    rp, cp = _padded(rows, cols)
    raw = scales.view(torch.uint8) if scales.element_size() == 1 else scales
    padded = torch.zeros((*lead, rp, cp), dtype=raw.dtype, device=raw.device)
    padded[..., :rows, :cols] = raw
    # m = 128*a + 32*b + c, k = 4*d + e  ->  memory order [a][d][c][b][e]
    tiled = padded.reshape(*lead, rp // 128, 4, 32, cp // 4, 4)
    n = len(lead)
    perm = (*range(n), n + 0, n + 3, n + 2, n + 1, n + 4)
    out = tiled.permute(perm).contiguous().reshape(*lead, rp, cp)
    return out.view(scales.dtype) if out.dtype != scales.dtype else out


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: back to row-major [..., rows, cols], padding dropped."""
    rp, cp = _padded(rows, cols)
    if swizzled.dim() < 2 or tuple(swizzled.shape[-2:]) != (rp, cp):
        raise ValueError(
            f"swizzled: expected trailing shape ({rp}, {cp}) for rows={rows}, cols={cols}, "
            f"got {tuple(swizzled.shape)}"
        )
    *lead, _, _ = swizzled.shape
    raw = swizzled.view(torch.uint8) if swizzled.element_size() == 1 else swizzled
    tiled = raw.contiguous().reshape(*lead, rp // 128, cp // 4, 32, 4, 4)  # [a][d][c][b][e]
    n = len(lead)
    perm = (*range(n), n + 0, n + 3, n + 2, n + 1, n + 4)  # -> [a][b][c][d][e]
    out = tiled.permute(perm).contiguous().reshape(*lead, rp, cp)[..., :rows, :cols].contiguous()
    return out.view(swizzled.dtype) if out.dtype != swizzled.dtype else out
