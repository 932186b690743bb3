"""In-register decoding of FP4 tiles (E2M1 codes, E4M3 / E8M0 scales) for every kernel.

The arithmetic mirrors ``fp4moe.formats`` (the reference) and is exact: an E2M1 value times an
E4M3 or E8M0 scale has at most 5 significant bits, so it is representable in bf16 and fp16
whenever it is in range. Only bit operations and fp32 multiplications by powers of two are
used, so the same code runs on SM80 (no FP8 conversion instructions) and in the interpreter.
"""

import triton
import triton.language as tl

# 2**126 and 2**120 as fp32 constants (exact)
_TWO_POW_126 = tl.constexpr(8.507059173023462e37)
_TWO_POW_120 = tl.constexpr(1.329227995784916e36)
_TWO_POW_M127 = tl.constexpr(5.877471754111438e-39)


@triton.jit
def e2m1_to_f32(codes):
    """E2M1 codes (integer tensor, values 0..15) to fp32.

    The 3 magnitude bits ``e1 e0 m`` are placed at fp32 bits 24..22 and the sign at bit 31:
    that is the value times 2**-126 (a subnormal for e = 0, which is what E2M1 does too), so
    one multiplication by 2**126 restores it exactly.
    """
    c = codes.to(tl.uint32)
    bits = ((c & 0x7) << 22) | ((c & 0x8) << 28)
    return bits.to(tl.float32, bitcast=True) * _TWO_POW_126


@triton.jit
def e4m3_to_f32(bits):
    """E4M3 bit patterns (uint8; scales are positive, the sign bit is ignored) to fp32.

    ``(b & 0x7F) << 20`` lines the 4 exponent and 3 mantissa bits up with fp32's, giving the
    value times 2**-120 (subnormal E4M3 land on fp32 subnormals); 2**120 restores it.
    """
    b = bits.to(tl.uint32) & 0x7F
    return (b << 20).to(tl.float32, bitcast=True) * _TWO_POW_120


@triton.jit
def e8m0_to_f32(bits):
    """E8M0 biased exponents (uint8) to fp32 2**(e - 127); e = 0 gives 2**-127."""
    e = bits.to(tl.uint32)
    normal = (e << 23).to(tl.float32, bitcast=True)
    return tl.where(e == 0, _TWO_POW_M127, normal)


@triton.jit
def decode_fp4_tile(packed, scales, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                    SCALE_E4M3: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Decode a tile of packed FP4 rows to ``OUT_DTYPE``.

    packed: uint8 [ROWS, BLOCK_K // 2], element 2j in the low nibble of byte j.
    scales: uint8 [ROWS, BLOCK_K // GROUP], E4M3 bits (SCALE_E4M3) or E8M0 exponents.
    Returns [ROWS, BLOCK_K] values ``e2m1 * scale`` (no global scale).
    """
    lo = e2m1_to_f32(packed & 0xF)
    hi = e2m1_to_f32(packed >> 4)
    values = tl.reshape(tl.join(lo, hi), (ROWS, BLOCK_K))
    if SCALE_E4M3:
        s = e4m3_to_f32(scales)
    else:
        s = e8m0_to_f32(scales)
    values = tl.reshape(values, (ROWS, BLOCK_K // GROUP, GROUP)) * s[:, :, None]
    return tl.reshape(values, (ROWS, BLOCK_K)).to(OUT_DTYPE)



# ----------------------------------------------------------------------------------------------
# Fast path (compiled CUDA only): four bytes -> eight bf16 in 23 instructions.
#
# lo4/hi4 = the low/high nibbles of the 4 bytes; prmt places two nibbles 16 bits apart with zero
# bytes between them (selector nibble 8 replicates the sign of a masked byte: 0x00); then
# ((t << 6) | (t << 12)) & 0x81C081C0 puts each nibble's magnitude bits at bf16 bits 8..6 and its
# sign at bit 15 of its half: the E2M1 value times 2**-126 (bf16 subnormal for code 1, as E2M1
# itself). One fma by the folded scale (scale * 2**F, see ``folded_scale_f32``) leaves
# value * scale * 2**(F - 126), exact, normal; the kernel multiplies its fp32 accumulator by
# 2**(126 - F) once. fma.rn.bf16x2 exists from sm_80 and keeps subnormal inputs.
_E2M1X8_TO_BF16 = tl.constexpr("""
{
.reg .b32 lo, hi, t, a, b, nz;
mov.b32 nz, 0x80008000;
and.b32 lo, $4, 0x0F0F0F0F;
shr.u32 hi, $4, 4;
and.b32 hi, hi, 0x0F0F0F0F;
prmt.b32 t, lo, 0, 0x8180;
shl.b32 a, t, 6;
shl.b32 b, t, 12;
lop3.b32 t, a, b, 0x81C081C0, 0xA8;
fma.rn.bf16x2 $0, t, $5, nz;
prmt.b32 t, lo, 0, 0x8382;
shl.b32 a, t, 6;
shl.b32 b, t, 12;
lop3.b32 t, a, b, 0x81C081C0, 0xA8;
fma.rn.bf16x2 $1, t, $6, nz;
prmt.b32 t, hi, 0, 0x8180;
shl.b32 a, t, 6;
shl.b32 b, t, 12;
lop3.b32 t, a, b, 0x81C081C0, 0xA8;
fma.rn.bf16x2 $2, t, $5, nz;
prmt.b32 t, hi, 0, 0x8382;
shl.b32 a, t, 6;
shl.b32 b, t, 12;
lop3.b32 t, a, b, 0x81C081C0, 0xA8;
fma.rn.bf16x2 $3, t, $6, nz;
}
""")

_TWO_POW_100 = tl.constexpr(1.2676506002282294e30)
#: what the fast path leaves on its products, to be multiplied back into the fp32 accumulator
FAST_FOLD_E4M3 = tl.constexpr(256.0)  # 2**(126 - 118)
FAST_FOLD_E8M0 = tl.constexpr(67108864.0)  # 2**(126 - 100)


@triton.jit
def fast_folded_scale(bits, SCALE_E4M3: tl.constexpr):
    """Block scale times 2**F as bf16 for the fast path: F = 118 for E4M3 (448 * 2**118 is finite;
    products value * scale * 2**-8 >= 2**-18 stay normal); F = 100 for E8M0 (exponents 21..154,
    i.e. scales 2**-106 .. 2**27, stay exact; real checkpoints sit far inside)."""
    if SCALE_E4M3:
        b = bits.to(tl.uint32) & 0x7F
        s = (b << 20).to(tl.float32, bitcast=True) * _TWO_POW_120 * 3.3230699894622896e35  # * 2**118
    else:
        s = e8m0_to_f32(bits) * _TWO_POW_100
    return s.to(tl.bfloat16)


@triton.jit
def decode_fp4_tile_fast(packed, scales, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                         SCALE_E4M3: tl.constexpr):
    """Like ``decode_fp4_tile`` with bf16 output, but values carry a factor 2**-(126 - F): multiply
    the accumulator by FAST_FOLD_E4M3 / FAST_FOLD_E8M0. Compiled CUDA only (inline PTX)."""
    s = fast_folded_scale(scales, SCALE_E4M3)  # [ROWS, BLOCK_K // GROUP]
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (ROWS, BLOCK_K // GROUP, GROUP // 2)), (ROWS, BLOCK_K // 2))
    lo, hi = tl.inline_asm_elementwise(_E2M1X8_TO_BF16, "=r,=r,=r,=r,r,r,r", [packed, s],
                                       dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return tl.reshape(tl.join(lo, hi), (ROWS, BLOCK_K))
