"""NVFP4 activation quantization: @triton.jit bodies (launchers in ``fp4moe.ops.quantize``).

The results equal ``fp4moe.quantize(x, "nvfp4", global_scale)`` bit for bit; the constants
are those of ``fp4moe.formats`` (E2M1 max 6, E4M3 max 448, smallest scale 2**-9). Only fp32
arithmetic with IEEE rounding and integer operations are used (no FP8/FP4 conversion
instruction), so the same code runs on SM80, every later target and the interpreter.

The reference divides twice: ``raw = amax_b / (6 g)`` per block and ``q = x / d`` per element
(``d = fp32(scale) * g``), then rounds q to E2M1 by comparing it with 7 thresholds. A full
IEEE division per element (``div.rn``: a reciprocal on the slow MUFU unit, a range check and
a branch) would make this memory-bound kernel compute-bound, so in the fast path:

* a division by d becomes a multiplication by ``RN(1/d)`` (one ``tl.math.div_rn`` per block;
  per program for 6g) and two FMA corrections (:func:`div_by_reciprocal`), exact by
  Markstein's theorem while the values stay in fp32's normal range, which
  ``2**-91 <= g <= 2**115`` guarantees; outside it the kernel uses ``div_rn`` throughout;
* q is rounded to E2M1 with three float additions and two minimums (:func:`e2m1_codes`);
* a block's scale is rounded to E4M3 with one magic-number addition (:func:`e4m3_round`).

The interpreter's ``tl.fma`` rounds twice, so there the kernels emulate an exact FMA in fp64
(``EMULATE_FMA``) and the CPU tests run the very algorithm the GPU runs.
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
def f32_to_e2m1_codes(q):
    """fp32 values (already divided by their scale) to E2M1 codes (int32, 0..15).

    Same rule as ``formats.e2m1_encode``: round to nearest, ties to the even code (a strict
    comparison where the lower neighbour is even), saturate at 6, keep the sign of values that
    round to zero (-0.1 -> code 8).
    """
    a = tl.abs(q)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    sign = (q.to(tl.int32, bitcast=True) >> 31) & 1
    return code | (sign << 3)


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
def div_by_reciprocal(a, d, y, EMULATE_FMA: tl.constexpr):
    """``RN(a / d)`` from ``y = RN(1 / d)`` with four fused multiply-adds (Markstein).

    q0 = RN(a y) is within 1.5 ulp of a / d; one correction makes it faithful (within 1 ulp),
    and with y within half an ulp of 1 / d, Markstein's theorem makes the second correction
    the correctly rounded quotient, its remainder a - d q being exact. Valid while a / d,
    the remainders and y stay normal (see the kernel's range check); tiny a gives a tiny q.
    """
    q = a * y
    q = fma_rn(fma_rn(-d, q, a, EMULATE_FMA), y, q, EMULATE_FMA)
    return fma_rn(fma_rn(-d, q, a, EMULATE_FMA), y, q, EMULATE_FMA)


@triton.jit
def e2m1_codes(q, x):
    """E2M1 codes of fp32 values 0 <= q < 7 with the sign of x, biased: 0x4B000000 + code (int32).

    c0 = RNE(2 q) is right for q <= 2, c1 = RNE(q) + 2 for 2 <= q <= 4, c2 = RNE(q / 2) + 4
    above, and each of them over-counts outside its range, so the magnitude code is
    min(c0, c1, c2). RNE(v) + k is read from the bits of the fp32 sum v + 2**23 + k (one
    rounding, ties to even; k even keeps the parity), which are 0x4B000000 + RNE(v) + k: the
    bias stays and :func:`pack_codes` removes it. Ties go to the even code as in
    ``formats.e2m1_encode``; the sign bit (code 8) comes from x, so -0.0 gives code 8.
    """
    c0 = q * 2.0 + 8388608.0  # 2**23
    c1 = q + 8388610.0
    c2 = q * 0.5 + 8388612.0
    magnitude = tl.minimum(tl.minimum(c0, c1), c2).to(tl.int32, bitcast=True)
    return magnitude + (x.to(tl.uint32, bitcast=True) >> 31).to(tl.int32) * 8


@triton.jit
def pack_codes(codes):
    """Biased codes [R, NB, 8] (0x4B000000 + code, code 0..15) to int32 words [R, NB]: code j in
    bits 4j..4j+3, so the little-endian bytes hold element 2j in the low nibble of byte j.

    The words are sums code_j * 16**j with wrap-around; the 8 biases add up to 0xFB000000
    (mod 2**32), which one addition of 0x05000000 cancels.
    """
    R: tl.constexpr = codes.shape[0]
    NB: tl.constexpr = codes.shape[1]
    lo, hi = tl.split(tl.reshape(codes, (R, NB, 4, 2)))
    lo, hi = tl.split(tl.reshape(lo + hi * 16, (R, NB, 2, 2)))
    lo, hi = tl.split(tl.reshape(lo + hi * 256, (R, NB, 1, 2)))
    return tl.reshape(lo + hi * 65536, (R, NB)) + 0x05000000


@triton.jit
def absmax_kernel(
    x_ptr,     # [M, K] bf16/fp16/fp32, rows stride_xm apart, last dim contiguous
    amax_ptr,  # [] int32: bits of the fp32 max |x|; the launcher zeroes it
    M, K, stride_xm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROW_STEPS: tl.constexpr,
):
    """max |x| over the whole tensor, for the dynamic global scale.

    Grid: (cdiv(M, BLOCK_M * ROW_STEPS), cdiv(K, BLOCK_K)). One program reduces ROW_STEPS
    tiles of [BLOCK_M, BLOCK_K] stacked along M and folds the result in with one integer
    atomic max (non-negative fp32 values are ordered like their bit patterns).
    """
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    for step in tl.static_range(ROW_STEPS):
        rows = (tl.program_id(0) * ROW_STEPS + step) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    tl.atomic_max(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0).to(tl.int32, bitcast=True))


@triton.jit
def nvfp4_quantize_kernel(
    x_ptr,       # [M, K] bf16/fp16/fp32, rows stride_xm apart, last dim contiguous
    data_ptr,    # [M, K // 8] int32 (the [M, K // 2] uint8 codes), contiguous: element 2j in the low nibble of byte j
    scales_ptr,  # [M, K // 16] uint8, contiguous: E4M3 bits of the block scales
    scale_ptr,   # [] fp32: the global scale g, or max |x| when DYNAMIC
    gs_out_ptr,  # [] fp32: receives g when DYNAMIC (untouched otherwise)
    M, K, stride_xm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    DYNAMIC: tl.constexpr, EMULATE_FMA: tl.constexpr,
):
    """Quantize x to NVFP4 (E2M1 codes, one E4M3 scale per 16 elements, an fp32 global scale g).

    Grid: (cdiv(M, BLOCK_M), cdiv(K, BLOCK_K)). One program quantizes the tile
    x[BLOCK_M rows, BLOCK_K columns], i.e. BLOCK_M x BLOCK_K/16 blocks, and writes
    data[those rows, BLOCK_K/8 words] and scales[those rows, BLOCK_K/16].
    Per block: scale = e4m3(clamp(amax_b / (6 g), 2**-9, 448)), 1.0 when amax_b is 0; each
    element's code = e2m1(x / (fp32(scale) * g)). A block's two halves come from two loads of
    the same layout, so one thread holds all 16 elements of its blocks (no cross-thread
    reduction, one packed 8-byte store per block).
    DYNAMIC: scale_ptr holds amax and every program derives the same g = amax / 2688 from it
    (a correctly rounded division, as ``fp4moe.quantize`` does on every device); program (0, 0)
    stores g. EMULATE_FMA: exact fused multiply-adds for the interpreter.
    """
    tl.static_assert(BLOCK_K % 16 == 0)
    NB: tl.constexpr = BLOCK_K // 16
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    blocks = pid_k * NB + tl.arange(0, NB)
    ok = (rows < M)[:, None] & (blocks < K // 16)[None, :]  # [BLOCK_M, NB]
    offs = rows64[:, None, None] * stride_xm + blocks[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
    x_lo = tl.load(x_ptr + offs, mask=ok[:, :, None], other=0.0).to(tl.float32)      # [BLOCK_M, NB, 8]
    x_hi = tl.load(x_ptr + offs + 8, mask=ok[:, :, None], other=0.0).to(tl.float32)  # [BLOCK_M, NB, 8]
    amax = tl.maximum(tl.max(tl.abs(x_lo), axis=2), tl.max(tl.abs(x_hi), axis=2))   # [BLOCK_M, NB]

    g = tl.load(scale_ptr)
    if DYNAMIC:  # g = amax / (6 * 448), 1.0 when amax is 0
        g = tl.where(g > 0, tl.math.div_rn(g, 2688.0), 1.0)
        if (pid_m == 0) & (pid_k == 0):
            tl.store(gs_out_ptr, g)

    if (g >= 4.0389678347315804e-28) & (g <= 4.153837486827862e34):  # 2**-91 .. 2**115
        # Fast path, all in the normal range: divisions by a reciprocal and two FMA corrections.
        six_g = g * 6.0
        raw = div_by_reciprocal(tl.minimum(amax, six_g * 512.0), six_g, tl.math.div_rn(1.0, six_g), EMULATE_FMA)
        d, sbits = nvfp4_block_scale(raw, amax, g)
        y = tl.math.div_rn(1.0, d)[:, :, None]
        cap = (d * 6.0)[:, :, None]  # |x| >= 6 d has code 7 either way; keeps q finite
        dd = d[:, :, None]
        c_lo = e2m1_codes(div_by_reciprocal(tl.minimum(tl.abs(x_lo), cap), dd, y, EMULATE_FMA), x_lo)
        c_hi = e2m1_codes(div_by_reciprocal(tl.minimum(tl.abs(x_hi), cap), dd, y, EMULATE_FMA), x_hi)
    else:
        d, sbits = nvfp4_block_scale(tl.math.div_rn(amax, g * 6.0), amax, g)
        c_lo = f32_to_e2m1_codes(tl.math.div_rn(x_lo, d[:, :, None])) + 0x4B000000  # biased like e2m1_codes
        c_hi = f32_to_e2m1_codes(tl.math.div_rn(x_hi, d[:, :, None])) + 0x4B000000

    words = tl.reshape(tl.join(pack_codes(c_lo), pack_codes(c_hi)), (BLOCK_M, 2 * NB))
    wcols = pid_k * (2 * NB) + tl.arange(0, 2 * NB)
    tl.store(data_ptr + rows64[:, None] * (K // 8) + wcols[None, :], words,
             mask=(rows < M)[:, None] & (wcols < K // 8)[None, :])
    tl.store(scales_ptr + rows64[:, None] * (K // 16) + blocks[None, :], sbits.to(tl.uint8), mask=ok)
