"""The exact fp32 arithmetic of NVFP4 quantization, as @triton.jit helpers of the quantize kernels
(``kernels.quantize``): block scales rounded to E4M3, divisions by reciprocals, E2M1 codes packed
into words, and the inline PTX of the bf16 path.

The results equal ``fp4moe.quantize(x, "nvfp4", global_scale)`` bit for bit; the constants
are those of ``fp4moe.formats`` (E2M1 max 6, E4M3 max 448, smallest scale 2**-9). Only fp32
arithmetic with IEEE rounding, exact comparisons and integer operations are used (no FP8/FP4
conversion instruction), so the same code runs on SM80, every later target and the interpreter.

The reference divides twice: ``raw = amax_b / (6 g)`` per block and ``q = x / d`` per element
(``d = fp32(scale) * g``), then rounds q to E2M1 by comparing it with 7 thresholds. The kernel
is bound by instruction issue rather than memory unless each element costs few instructions:
a full IEEE division per element (``div.rn``: a reciprocal on the slow MUFU unit, a range
check and a branch) is out of the question, so in the fast path:

* a division a / d (a >= 0) uses, per block, y = RN(1/d) and y_lo = RN((1 - d y) y)
  (:func:`reciprocal_pair`; 1 - d y is exact) and, per element, a product and three fused
  multiply-adds (:func:`div_by_reciprocal_pair`): q0 = RN(a y + RN(a y_lo)) rounds
  a/d (1 + e) with |e| <= 2**-34 (y + y_lo is 1/d within 2**-47/d, the product's error and
  y_lo's underflow add at most 2**-48 and d * 2**-150 <= 2**-41 relative), so q0 is faithful;
  the remainder r = a - d q0 is then exact and RN(q0 + r y) = RN(a/d) by Markstein's theorem.
  This holds while d, y and the quotients that matter (>= 2**-3; smaller ones give code 0
  whatever their last bits) keep r's granule 2**(e_d + e_q - 46) >= 2**-149, which
  ``2**-91 <= g <= 2**100`` guarantees (d in [2**-100, 2**109]); outside it the kernel uses
  ``div_rn`` throughout. The same division gives raw = amax_b / (6 g);
* bf16 and fp16 dividends (at most 11 significant bits) drop y_lo: q0 = RN(a y), then the same
  correction, a product and two fused multiply-adds per element (:func:`div_by_reciprocal`,
  ptxas' own ``div.rn`` sequence), checked exhaustively over every such significand and every
  divisor significand; fp32 input keeps the pair;
* q is rounded to E2M1 with three float additions and two minimums (:func:`e2m1_magnitudes`),
  after |x| is clamped to 6 d to keep q below 7, only in programs holding a block where
  amax / d can reach that (a saturated scale, or one rounded far down in E4M3's subnormal range);
* a block's scale is rounded to E4M3 with one magic-number addition (:func:`e4m3_round`).

Compiled for a GPU, bf16 input is read as int32 pairs and a few steps use inline PTX (SM80+):
block maxima with ``max.bf16x2`` on the pairs' magnitudes (a comparison, exact; on SM86+
``max.xorsign.abs.bf16x2`` takes the magnitudes itself), the sign bits gathered with byte
permutes, and RN(1/d) from an approximate reciprocal and two Newton-Raphson steps without a
range check, which d in [2**-100, 2**109] never needs. The interpreter computes the same values with plain Triton (``EMULATE_FMA``).

The interpreter's ``tl.fma`` rounds twice, so there the kernels emulate an exact FMA in fp64
(``EMULATE_FMA``) and the CPU tests run the very algorithm the GPU runs (the inline PTX aside,
which the GPU tests check bit for bit).
"""
import triton
import triton.language as tl


@triton.jit
def e4m3_round(v):
    """Round positive fp32 values in [2**-9, 448] to E4M3, nearest even: returns (value fp32, bits int32).

    The E4M3 quantum at v is 2**(max(e, -6) - 3) (e = v's exponent; below 2**-6 the subnormal
    quantum 2**-9). Adding M = quantum * 2**23 rounds v to a multiple of it, ties to even, and
    subtracting M again is exact. The bits: value * 2**-120 puts E4M3's exponent (bias 7) and
    3 mantissa bits in fp32's bits 30..20 (E4M3 subnormals land on fp32 subnormals), so they
    are ``bits >> 20``. Same results as torch's ``.to(torch.float8_e4m3fn)`` (tested exhaustively).
    """
    exp = v.to(tl.int32, bitcast=True) & 0x7F800000
    magic = (tl.maximum(exp, 121 << 23) + (20 << 23)).to(tl.float32, bitcast=True)
    value = (v + magic) - magic
    bits = (value * 7.52316384526264e-37).to(tl.int32, bitcast=True) >> 20  # 2**-120
    return value, bits


@triton.jit
def nvfp4_block_scale(raw, amax, g):
    """Block scales from raw = RN(amax / (6 g)): returns (d = fp32(scale) * g, E4M3 bits as int32).

    scale = e4m3(clamp(raw, 2**-9, 448)), 1.0 (bits 0x38) for an all-zero block.
    """
    scale, bits = e4m3_round(tl.minimum(tl.maximum(raw, 0.001953125), 448.0))
    scale = tl.where(amax == 0, 1.0, scale)
    return scale * g, tl.where(amax == 0, 0x38, bits)


@triton.jit
def fma_rn(a, b, c, EMULATE_FMA: tl.constexpr):
    """fp32 ``RN(a * b + c)``, rounded once.

    The interpreter's ``tl.fma`` rounds twice, so with EMULATE_FMA it is computed in fp64:
    a * b is exact there, the sum is rounded to odd (TwoSum error, then the last bit forced to 1
    when inexact), and rounding that to fp32 is the correctly rounded result (53 >= 24 + 2 bits).
    """
    if EMULATE_FMA:
        p = a.to(tl.float64) * b
        c64 = c.to(tl.float64)
        s = p + c64
        t = s - p
        err = (p - (s - t)) + (c64 - t)
        bits = s.to(tl.int64, bitcast=True)
        away = tl.where((err > 0) == (s > 0), 1, -1).to(tl.int64)
        bits = tl.where((err != 0) & ((bits & 1) == 0), bits + away, bits)
        return bits.to(tl.float64, bitcast=True).to(tl.float32)
    else:
        return tl.fma(a, b, c)


@triton.jit
def reciprocal_rn_asm(d):
    """RN(1 / d) for normal d whose reciprocal is normal: ``rcp.approx`` and two Newton-Raphson
    steps, the last one rounding correctly (ptxas' ``div.rn`` takes one step and corrects the
    quotient instead; the GPU sweep checks this reciprocal against 1 / d), without a range check
    and branch to a slow path, which the kernel's range (|d| in [2**-100, 2**109]) never needs."""
    return tl.inline_asm_elementwise(
        """{
        .reg .f32 r, e;
        rcp.approx.ftz.f32 r, $1;
        fma.rn.f32 e, $1, r, 0fBF800000;
        neg.f32 e, e;
        fma.rn.f32 r, r, e, r;
        fma.rn.f32 e, $1, r, 0fBF800000;
        neg.f32 e, e;
        fma.rn.f32 $0, r, e, r;
        }""", "=f,f", [d], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def reciprocal_rn(d, EMULATE_FMA: tl.constexpr):
    """RN(1 / d) for the kernel's divisors (:func:`reciprocal_rn_asm` when compiled)."""
    if EMULATE_FMA:
        return tl.math.div_rn(1.0, d)
    else:
        return reciprocal_rn_asm(d)


@triton.jit
def reciprocal_pair(d, EMULATE_FMA: tl.constexpr):
    """``(y, y_lo)``: y = RN(1 / d) and y_lo = RN((1 - d y) y), so that y + y_lo = 1 / d within
    2**-47 / d (1 - d y is exact, |1 - d y| <= 2**-24)."""
    if EMULATE_FMA:
        y = tl.math.div_rn(1.0, d)
        return y, fma_rn(-d, y, tl.zeros_like(d) + 1.0, EMULATE_FMA) * y
    else:
        y = reciprocal_rn_asm(d)
        return y, tl.fma(-d, y, 1.0) * y


@triton.jit
def div_by_reciprocal_pair(a, d, y, y_lo, EMULATE_FMA: tl.constexpr):
    """``RN(a / d)`` for a >= 0 from :func:`reciprocal_pair` with three fused multiply-adds and a product.

    q0 = RN(a y + RN(a y_lo)) is a rounding of a / d (1 + e) with |e| <= 2**-34 in the kernel's
    range, hence faithful (within 1 ulp); then r = a - d q0 is exact and, y being RN(1 / d),
    RN(q0 + r y) is the correctly rounded quotient (Markstein's theorem). Valid under the same
    range conditions (module docstring; the kernel checks them per call).
    """
    q = fma_rn(a, y, a * y_lo, EMULATE_FMA)
    return fma_rn(fma_rn(-d, q, a, EMULATE_FMA), y, q, EMULATE_FMA)


@triton.jit
def div_by_reciprocal(a, d, y, EMULATE_FMA: tl.constexpr):
    """``RN(a / d)`` for a >= 0 with at most 11 significant bits (bf16 or fp16 values), from
    y = RN(1 / d): q0 = RN(a y), r = a - d q0 (exact), RN(q0 + r y), a product and two fused
    multiply-adds (the sequence of ptxas' ``div.rn`` fast path).

    Unlike :func:`div_by_reciprocal_pair` no bound makes q0 faithful for every fp32 a, so this is
    used only where a's significand is short, and for those it was checked exhaustively: every
    bf16 significand against every fp32 divisor significand in [1, 2) (``tools/sweep/sweep_quantize.py
    --exhaustive``, also fp16 on the GPU; bf16 on the CPU with an exact fused multiply-add). Every
    operation scales by powers of two, so in the kernel's range (module docstring) that covers all
    exponents."""
    q = a * y
    return fma_rn(fma_rn(-d, q, a, EMULATE_FMA), y, q, EMULATE_FMA)


@triton.jit
def e2m1_magnitudes(q):
    """E2M1 magnitude codes of fp32 values 0 <= q < 7, biased: 0x4B000000 + code (0..7, int32).

    c0 = RNE(2 q) is right for q <= 2, c1 = RNE(q) + 2 for 2 <= q <= 4, c2 = RNE(q / 2) + 4
    above, and each of them over-counts outside its range, so the code is min(c0, c1, c2).
    RNE(v) + k is read from the bits of the fp32 sum v + 2**23 + k (one rounding, ties to even;
    k even keeps the parity), which are 0x4B000000 + RNE(v) + k: the bias stays and
    :func:`pack_magnitudes` removes it. Ties go to the even code as in ``formats.e2m1_encode``;
    the signs are added separately (:func:`sign_bits`, ``bf16_signs_asm``)."""
    c0 = q * 2.0 + 8388608.0  # 2**23
    c1 = q + 8388610.0
    c2 = q * 0.5 + 8388612.0
    return tl.minimum(tl.minimum(c0, c1), c2).to(tl.int32, bitcast=True)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def pack_magnitudes(m_lo, m_hi):
    """Biased magnitudes (:func:`e2m1_magnitudes`) of 8 consecutive elements, given as the even
    (``lo``) and odd (``hi``) ones [R, NB, 4], to int32 words [R, NB]: element 2k in bits 8k..8k+2,
    element 2k+1 in bits 8k+4..8k+6 (bit 3 of each nibble, the sign, left 0).

    The words are sums code_j * 16**j with wrap-around; the 8 biases add up to 0xFB000000
    (mod 2**32), which one addition of 0x05000000 cancels.
    """
    R: tl.constexpr = m_lo.shape[0]
    NB: tl.constexpr = m_lo.shape[1]
    lo, hi = tl.split(tl.reshape(m_lo + m_hi * 16, (R, NB, 2, 2)))
    lo, hi = tl.split(tl.reshape(lo + hi * 256, (R, NB, 1, 2)))
    return tl.reshape(lo + hi * 65536, (R, NB)) + 0x05000000


@triton.jit
def sign_bits(x_lo, x_hi):
    """The sign bits of 8 consecutive elements (even ``x_lo``, odd ``x_hi``, fp32 [R, NB, 4]) at bit
    3 of their nibbles (bits 8k + 3 and 8k + 7), -0.0 included: int32 [R, NB]."""
    k8 = tl.arange(0, 4)[None, None, :] * 8
    bits = (((x_lo.to(tl.int32, bitcast=True) >> 31) & (8 << k8))
            | ((x_hi.to(tl.int32, bitcast=True) >> 31) & (0x80 << k8)))
    return tl.reduce(bits, 2, _or)


@triton.jit
def _words4(w):
    """int32 [R, NB, 4] -> its 4 words [R, NB] (in-thread split)."""
    a, b = tl.split(tl.reshape(w, (w.shape[0], w.shape[1], 2, 2)))  # a = (w0, w2), b = (w1, w3)
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def bf16_absmax_asm(u, v, XORSIGN: tl.constexpr):
    """max |x| over 16 bf16 elements held as two [R, NB, 4] int32 tensors of packed pairs, as fp32
    [R, NB]: a tree of ``max.bf16x2`` on the magnitudes (exact on non-negative values, subnormals
    included), then the two halves. XORSIGN (SM86+): ``max.xorsign.abs.bf16x2`` takes the
    magnitudes itself (its result's sign, an XOR of the operands' signs, is masked off once at the
    end); otherwise the sign bits are masked off first (SM80). The interpreter uses :func:`_absmax4`."""
    u0, u1, u2, u3 = _words4(u)
    v0, v1, v2, v3 = _words4(v)
    if XORSIGN:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 a0, a1, a2, a3;
            max.xorsign.abs.bf16x2 a0, $1, $2;
            max.xorsign.abs.bf16x2 a1, $3, $4;
            max.xorsign.abs.bf16x2 a2, $5, $6;
            max.xorsign.abs.bf16x2 a3, $7, $8;
            max.xorsign.abs.bf16x2 a0, a0, a1;
            max.xorsign.abs.bf16x2 a2, a2, a3;
            max.xorsign.abs.bf16x2 a0, a0, a2;
            prmt.b32 a1, a0, 0, 0x1032;
            max.xorsign.abs.bf16x2 a0, a0, a1;
            and.b32 $0, a0, 0x7fff0000;
            }""",
            "=r,r,r,r,r,r,r,r,r", [u0, u1, u2, u3, v0, v1, v2, v3], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 a0, a1, a2, a3, a4, a5, a6, a7;
            and.b32 a0, $1, 0x7fff7fff;
            and.b32 a1, $2, 0x7fff7fff;
            and.b32 a2, $3, 0x7fff7fff;
            and.b32 a3, $4, 0x7fff7fff;
            and.b32 a4, $5, 0x7fff7fff;
            and.b32 a5, $6, 0x7fff7fff;
            and.b32 a6, $7, 0x7fff7fff;
            and.b32 a7, $8, 0x7fff7fff;
            max.bf16x2 a0, a0, a1;
            max.bf16x2 a2, a2, a3;
            max.bf16x2 a4, a4, a5;
            max.bf16x2 a6, a6, a7;
            max.bf16x2 a0, a0, a2;
            max.bf16x2 a4, a4, a6;
            max.bf16x2 a0, a0, a4;
            prmt.b32 a1, a0, 0, 0x1032;
            max.bf16x2 a0, a0, a1;
            and.b32 $0, a0, 0xffff0000;
            }""",
            "=r,r,r,r,r,r,r,r,r", [u0, u1, u2, u3, v0, v1, v2, v3], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def bf16_signs_asm(w, magnitudes):
    """``magnitudes | sign_bits(...)`` for 8 bf16 elements held as [R, NB, 4] int32 packed pairs,
    with byte permutes: the bytes holding the sign bits (bytes 1 and 3 of each pair) are gathered
    into A = elements 0, 2, 4, 6, each byte replaced by its sign replicated (0x00 or 0xFF: the
    permute's sign-extension selectors 8..15), and B = elements 1, 3, 5, 7 as they are; the word
    is magnitudes | A & 0x08080808 | B & 0x80808080 (two three-input logic operations)."""
    w0, w1, w2, w3 = _words4(w)
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 p, q, a, b;
        prmt.b32 p, $1, $2, 0x7351;
        prmt.b32 q, $3, $4, 0x7351;
        prmt.b32 a, p, q, 0xDC98;
        prmt.b32 b, p, q, 0x7632;
        and.b32 a, a, 0x08080808;
        or.b32 a, a, $5;
        and.b32 b, b, 0x80808080;
        or.b32 $0, a, b;
        }""",
        "=r,r,r,r,r,r", [w0, w1, w2, w3, magnitudes], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def bf16_magnitudes_asm(w):
    """Packed bf16 pairs (int32) to the fp32 magnitudes |x| of the (even, odd) elements: a shift or a
    mask and an ``abs.f32`` inside the asm, which ptxas folds into the consumer's |.| operand
    modifier (outside, LLVM would turn |x| of a bitcast integer into an integer mask)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t, u;
        shl.b32 t, $2, 16;
        and.b32 u, $2, 0xffff0000;
        abs.f32 $0, t;
        abs.f32 $1, u;
        }""", "=r,=r,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _absmax4(lo0, hi0, lo1, hi1):
    return tl.max(tl.maximum(tl.maximum(tl.abs(lo0), tl.abs(hi0)), tl.maximum(tl.abs(lo1), tl.abs(hi1))), axis=2)
