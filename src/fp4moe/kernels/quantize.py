"""NVFP4 activation quantization: @triton.jit bodies (launchers in ``fp4moe.ops.quantize``);
at the end, its inverse for the W4A4 path of GPUs without FP4 MMA (``nvfp4_dequantize_kernel``).

The results equal ``fp4moe.quantize(x, "nvfp4", global_scale)`` bit for bit. The arithmetic that
makes them so (divisions by reciprocals, E2M1 and E4M3 rounding, the bf16 path's inline PTX, the
exact FMA the interpreter needs: ``EMULATE_FMA``) is ``kernels.quantize_arith``'s, its docstring the
derivation; here are the kernels: the tiles a program loads, quantizes and stores, the global
scale, and the dequantize kernels.
"""

import triton
import triton.language as tl

from .fp4_decode import e2m1_to_f32, e4m3_to_f32
from .gemm_wgmma import stored_pair
from .pdl import pdl_enter
from .quantize_arith import (_absmax4, bf16_absmax_asm, bf16_magnitudes_asm, bf16_signs_asm, div_by_reciprocal,
                             div_by_reciprocal_pair, e2m1_magnitudes, nvfp4_block_scale, pack_magnitudes,
                             reciprocal_pair, reciprocal_rn, sign_bits)


@triton.jit
def absmax_kernel(
    x_ptr,     # [M, K] bf16/fp16/fp32, rows stride_xm apart, last dim contiguous
    amax_ptr,  # int32 bits of fp32 maxima: [] zeroed by the launcher, or [programs] (PARTIALS)
    M, K, stride_xm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROW_STEPS: tl.constexpr, PARTIALS: tl.constexpr,
    PDL: tl.constexpr,
):
    """max |x| over the whole tensor, for the dynamic global scale.

    Grid: (cdiv(M, BLOCK_M * ROW_STEPS), cdiv(K, BLOCK_K)). One program reduces ROW_STEPS
    tiles of [BLOCK_M, BLOCK_K] stacked along M and folds the result in with one integer
    atomic max (non-negative fp32 values are ordered like their bit patterns), or with PARTIALS
    stores it as its own entry (row-major over the grid), which the quantize kernels reduce
    themselves (:func:`_global_scale`): no zeroed word, so no fill kernel before this one, for
    grids small enough that every quantize program can read them all.
    """
    pdl_enter(PDL)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    for step in tl.static_range(ROW_STEPS):
        rows = (tl.program_id(0) * ROW_STEPS + step) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    bits = tl.max(tl.max(acc, axis=1), axis=0).to(tl.int32, bitcast=True)
    if PARTIALS:
        tl.store(amax_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), bits)
    else:
        tl.atomic_max(amax_ptr, bits)


@triton.jit
def _quarter_word(lo, hi, w, d, y, y_lo, cap, FAST: tl.constexpr, SHORT: tl.constexpr, CAP: tl.constexpr,
                  ASM: tl.constexpr, EMULATE_FMA: tl.constexpr):
    """The code word of one quarter (8 elements as even/odd [BM, NC, 4], and their packed bf16
    pairs ``w`` when ASM) of blocks with scale d. SHORT: the elements are bf16/fp16 values
    (:func:`div_by_reciprocal`; y_lo is not used). CAP (FAST): clamp |x| to ``cap`` = 6 d first,
    which keeps q below 7, the domain of :func:`e2m1_magnitudes`; without it every |x| / d must
    already be below 7 (the caller checks)."""
    if ASM:  # lo and hi are magnitudes already
        a_lo, a_hi = lo, hi
    else:
        a_lo, a_hi = tl.abs(lo), tl.abs(hi)
    if FAST and CAP:  # a capped element is 6 d rounded, a full significand, but its code is 7 either way
        a_lo = tl.minimum(a_lo, cap)
        a_hi = tl.minimum(a_hi, cap)
    if FAST and SHORT:
        m_lo = e2m1_magnitudes(div_by_reciprocal(a_lo, d, y, EMULATE_FMA))
        m_hi = e2m1_magnitudes(div_by_reciprocal(a_hi, d, y, EMULATE_FMA))
    elif FAST:
        m_lo = e2m1_magnitudes(div_by_reciprocal_pair(a_lo, d, y, y_lo, EMULATE_FMA))
        m_hi = e2m1_magnitudes(div_by_reciprocal_pair(a_hi, d, y, y_lo, EMULATE_FMA))
    else:
        # every q >= 6 has the saturated code: clamping keeps e2m1_magnitudes in its domain
        m_lo = e2m1_magnitudes(tl.minimum(tl.math.div_rn(a_lo, d), 6.0))
        m_hi = e2m1_magnitudes(tl.minimum(tl.math.div_rn(a_hi, d), 6.0))
    if ASM:
        return bf16_signs_asm(w, pack_magnitudes(m_lo, m_hi))
    else:
        return pack_magnitudes(m_lo, m_hi) | sign_bits(lo, hi)


@triton.jit
def _code_words(lo0, hi0, w0, lo1, hi1, w1, lo2, hi2, w2, lo3, hi3, w3,  # the chunks' quarters
                da, ya, yla, cap_a, db, yb, ylb, cap_b,  # blocks A (quarters 0, 1) and B (2, 3)
                FAST: tl.constexpr, SHORT: tl.constexpr, CAP: tl.constexpr, ASM: tl.constexpr,
                EMULATE_FMA: tl.constexpr):
    """The code words of a tile's chunks, [BM, NC, 4] in memory order (:func:`_quarter_word` each:
    join(join(q0, q2), join(q1, q3))[..., k, i] = q_{2k+i})."""
    q0 = _quarter_word(lo0, hi0, w0, da, ya, yla, cap_a, FAST, SHORT, CAP, ASM, EMULATE_FMA)
    q1 = _quarter_word(lo1, hi1, w1, da, ya, yla, cap_a, FAST, SHORT, CAP, ASM, EMULATE_FMA)
    q2 = _quarter_word(lo2, hi2, w2, db, yb, ylb, cap_b, FAST, SHORT, CAP, ASM, EMULATE_FMA)
    q3 = _quarter_word(lo3, hi3, w3, db, yb, ylb, cap_b, FAST, SHORT, CAP, ASM, EMULATE_FMA)
    return tl.reshape(tl.join(tl.join(q0, q2), tl.join(q1, q3)), (q0.shape[0], q0.shape[1], 4))


@triton.jit
def _load_raw_quarter(x_ptr, rows, chunks, stride_xm, QUARTER: tl.constexpr, mask, WORDS: tl.constexpr):
    """Elements 32 c + 8 QUARTER + 0..7 of the tile's rows as loaded: bf16 (WORDS) as packed pairs,
    int32 [BM, NC, 4] (one 16-byte load per thread and chunk); other dtypes as [BM, NC, 8]."""
    if WORDS:
        k = tl.arange(0, 4)
        offs = rows[:, None, None] * (stride_xm // 2) + chunks[None, :, None] * 16 + k[None, None, :]
        if mask is None:
            return tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + QUARTER * 4 + offs)
        else:
            return tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + QUARTER * 4 + offs, mask=mask[:, :, None], other=0)
    else:
        e = tl.arange(0, 8)
        offs = rows[:, None, None] * stride_xm + chunks[None, :, None] * 32 + e[None, None, :]
        if mask is None:
            return tl.load(x_ptr + QUARTER * 8 + offs)
        else:
            return tl.load(x_ptr + QUARTER * 8 + offs, mask=mask[:, :, None], other=0.0)


@triton.jit
def _unpack_quarter(raw, WORDS: tl.constexpr, ASM: tl.constexpr):
    """A loaded quarter (:func:`_load_raw_quarter`) as (even, odd) fp32 [BM, NC, 4] and, for bf16,
    the packed pairs (otherwise the third value repeats the even elements and is not read);
    with ASM the first two are magnitudes (the signs are read from the pairs)."""
    if WORDS:
        if ASM:
            lo, hi = bf16_magnitudes_asm(raw)
        else:
            lo, hi = (raw << 16).to(tl.float32, bitcast=True), (raw & -65536).to(tl.float32, bitcast=True)
        return lo, hi, raw
    else:
        v = raw.to(tl.float32)
        lo, hi = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], 4, 2)))
        return lo, hi, lo


@triton.jit
def _load_tile(x_ptr, rows_left, nblocks_left, stride_xm,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, MASKED: tl.constexpr):
    """The four raw quarters of a [BLOCK_M, BLOCK_K] tile (x_ptr at its first element)."""
    WORDS: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    rows = tl.arange(0, BLOCK_M)
    chunks = tl.arange(0, BLOCK_K // 32)
    if MASKED:  # valid (row, chunk) pairs of block A and of block B [BM, NC]
        row_ok = rows < rows_left
        ok_a = row_ok[:, None] & (chunks * 2 < nblocks_left)[None, :]
        ok_b = row_ok[:, None] & (chunks * 2 + 1 < nblocks_left)[None, :]
    else:
        ok_a = None
        ok_b = None
    r0 = _load_raw_quarter(x_ptr, rows, chunks, stride_xm, 0, ok_a, WORDS)
    r1 = _load_raw_quarter(x_ptr, rows, chunks, stride_xm, 1, ok_a, WORDS)
    r2 = _load_raw_quarter(x_ptr, rows, chunks, stride_xm, 2, ok_b, WORDS)
    r3 = _load_raw_quarter(x_ptr, rows, chunks, stride_xm, 3, ok_b, WORDS)
    return r0, r1, r2, r3


@triton.jit
def _quantize_loaded(
    r0, r1, r2, r3,  # the tile's quarters (:func:`_load_tile`)
    g, WORDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, FAST: tl.constexpr,
    SM86: tl.constexpr, EMULATE_FMA: tl.constexpr,
):
    """Quantize one loaded [BLOCK_M, BLOCK_K] tile: its code words [BM, NC, 4] and the E4M3 bits of
    the scales of blocks A and B of each chunk ([BM, NC] each). A thread holds chunks of 32
    consecutive elements (two blocks, A and B), loaded as four 8-element quarters of one layout, so
    that all 16 elements of a block are in one thread (no cross-thread reduction); it then stores
    its chunk's 4 code words (16 bytes) and 2 scale bytes with one store each (:func:`_store_codes`)
    or their 32 values (:func:`_store_values`). Elements masked off at the load are zeros.
    bf16 is read as packed pairs (int32); compiled (not EMULATE_FMA), their block maxima and sign
    bits are computed two elements at a time with inline PTX (SM80+; SM86 selects the
    ``max.xorsign.abs`` form of the maxima)."""
    ASM: tl.constexpr = WORDS and not EMULATE_FMA
    SHORT: tl.constexpr = r0.dtype != tl.float32  # bf16 (as int32 pairs) or fp16 elements
    lo0, hi0, w0 = _unpack_quarter(r0, WORDS, ASM)
    lo1, hi1, w1 = _unpack_quarter(r1, WORDS, ASM)
    lo2, hi2, w2 = _unpack_quarter(r2, WORDS, ASM)
    lo3, hi3, w3 = _unpack_quarter(r3, WORDS, ASM)
    if ASM:
        amax_a = bf16_absmax_asm(w0, w1, SM86)  # [BM, NC]
        amax_b = bf16_absmax_asm(w2, w3, SM86)
    else:
        amax_a = _absmax4(lo0, hi0, lo1, hi1)
        amax_b = _absmax4(lo2, hi2, lo3, hi3)

    if FAST and SHORT:  # (a capped amax gives raw ~ 512, saturated to 448 either way)
        six_g = g * 6.0
        y6 = reciprocal_rn(six_g, EMULATE_FMA)
        raw_cap = six_g * 512.0
        d_a, s_a = nvfp4_block_scale(div_by_reciprocal(tl.minimum(amax_a, raw_cap), six_g, y6, EMULATE_FMA),
                                     amax_a, g)
        d_b, s_b = nvfp4_block_scale(div_by_reciprocal(tl.minimum(amax_b, raw_cap), six_g, y6, EMULATE_FMA),
                                     amax_b, g)
        y_a = reciprocal_rn(d_a, EMULATE_FMA)
        y_b = reciprocal_rn(d_b, EMULATE_FMA)
        ylo_a, ylo_b = y_a, y_b  # unused
    elif FAST:
        six_g = g * 6.0
        y6, y6_lo = reciprocal_pair(six_g, EMULATE_FMA)
        raw_cap = six_g * 512.0
        d_a, s_a = nvfp4_block_scale(div_by_reciprocal_pair(tl.minimum(amax_a, raw_cap), six_g, y6, y6_lo,
                                                            EMULATE_FMA), amax_a, g)
        d_b, s_b = nvfp4_block_scale(div_by_reciprocal_pair(tl.minimum(amax_b, raw_cap), six_g, y6, y6_lo,
                                                            EMULATE_FMA), amax_b, g)
        y_a, ylo_a = reciprocal_pair(d_a, EMULATE_FMA)
        y_b, ylo_b = reciprocal_pair(d_b, EMULATE_FMA)
    else:
        d_a, s_a = nvfp4_block_scale(tl.math.div_rn(amax_a, g * 6.0), amax_a, g)
        d_b, s_b = nvfp4_block_scale(tl.math.div_rn(amax_b, g * 6.0), amax_b, g)
        y_a, ylo_a, y_b, ylo_b = d_a, d_a, d_b, d_b  # unused
    cap_a = (d_a * 6.0)[:, :, None]  # |x| >= 6 d has code 7 either way; keeps q below 7
    cap_b = (d_b * 6.0)[:, :, None]
    da, ya, yla = d_a[:, :, None], y_a[:, :, None], ylo_a[:, :, None]
    db, yb, ylb = d_b[:, :, None], y_b[:, :, None], ylo_b[:, :, None]
    # |x| / d reaches 7 only where the scale saturated at 448 or rounded far down in E4M3's subnormal
    # range (a normal scale keeps amax / d <= 6 * (1 + 2**-4)): only programs holding such a block
    # clamp every element (one per-program reduction instead of a minimum per element)
    if FAST:
        if tl.max(((amax_a > d_a * 6.5) | (amax_b > d_b * 6.5)).to(tl.int32)) != 0:
            words = _code_words(lo0, hi0, w0, lo1, hi1, w1, lo2, hi2, w2, lo3, hi3, w3, da, ya, yla, cap_a,
                                db, yb, ylb, cap_b, True, SHORT, True, ASM, EMULATE_FMA)
        else:
            words = _code_words(lo0, hi0, w0, lo1, hi1, w1, lo2, hi2, w2, lo3, hi3, w3, da, ya, yla, cap_a,
                                db, yb, ylb, cap_b, True, SHORT, False, ASM, EMULATE_FMA)
    else:
        words = _code_words(lo0, hi0, w0, lo1, hi1, w1, lo2, hi2, w2, lo3, hi3, w3, da, ya, yla, cap_a,
                            db, yb, ylb, cap_b, False, SHORT, True, ASM, EMULATE_FMA)
    return words, s_a, s_b


@triton.jit
def _store_codes(words, s_a, s_b, data_ptr, scales_ptr, rows_left, nblocks_left, words_per_row, scales_per_row,
                 MASKED: tl.constexpr):
    """A quantized tile's code words [BM, NC, 4] and block scales (E4M3 bits [BM, NC] of blocks A
    and B of each chunk) to memory: one 16-byte and one 2-byte store per thread and chunk."""
    BLOCK_M: tl.constexpr = words.shape[0]
    NC: tl.constexpr = words.shape[1]
    rows = tl.arange(0, BLOCK_M)
    chunks = tl.arange(0, NC)
    sbits = tl.join(s_a, s_b).to(tl.uint8)  # [BM, NC, 2]
    four = tl.arange(0, 4)
    two = tl.arange(0, 2)
    w_offs = rows[:, None, None] * words_per_row + chunks[None, :, None] * 4 + four[None, None, :]
    s_offs = rows[:, None, None] * scales_per_row + chunks[None, :, None] * 2 + two[None, None, :]
    if MASKED:
        row_ok = rows < rows_left
        w_ok = row_ok[:, None, None] & ((chunks[None, :, None] * 2 + four[None, None, :] // 2) < nblocks_left)
        s_ok = row_ok[:, None, None] & ((chunks[None, :, None] * 2 + two[None, None, :]) < nblocks_left)
        tl.store(data_ptr + w_offs, words, mask=w_ok)
        tl.store(scales_ptr + s_offs, sbits, mask=s_ok)
    else:
        tl.store(data_ptr + w_offs, words)
        tl.store(scales_ptr + s_offs, sbits)


@triton.jit
def _store_values(words, s_a, s_b, out_ptr, rows_left, nblocks_left, stride_om, MASKED: tl.constexpr):
    """A quantized tile as the bf16 values its codes stand for, ``e2m1(code) * e4m3(scale)``
    without the global scale (exact in bf16: what ``nvfp4_dequantize_kernel`` makes of the stored
    codes), [BM, 32 NC] at out_ptr: each thread decodes its own chunk's 4 words and 2 scales."""
    BLOCK_M: tl.constexpr = words.shape[0]
    NC: tl.constexpr = words.shape[1]
    four = tl.arange(0, 4)[None, None, :]
    scale = tl.where(four < 2, e4m3_to_f32(s_a)[:, :, None], e4m3_to_f32(s_b)[:, :, None])  # word w's block
    v0 = e2m1_to_f32(words & 0xF) * scale  # element 8 w + j is nibble j of word w
    v1 = e2m1_to_f32((words >> 4) & 0xF) * scale
    v2 = e2m1_to_f32((words >> 8) & 0xF) * scale
    v3 = e2m1_to_f32((words >> 12) & 0xF) * scale
    v4 = e2m1_to_f32((words >> 16) & 0xF) * scale
    v5 = e2m1_to_f32((words >> 20) & 0xF) * scale
    v6 = e2m1_to_f32((words >> 24) & 0xF) * scale
    v7 = e2m1_to_f32((words >> 28) & 0xF) * scale
    # each join appends its pair's index as the last dimension, so this is [BM, NC, 4, 2, 2, 2] indexed
    # (w, j >> 2, (j >> 1) & 1, j & 1): element 8 w + j in memory order
    v = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    v = tl.reshape(v, (BLOCK_M, NC, 32)).to(tl.bfloat16)
    rows = tl.arange(0, BLOCK_M)
    chunks = tl.arange(0, NC)
    e = tl.arange(0, 32)
    offs = rows[:, None, None] * stride_om + chunks[None, :, None] * 32 + e[None, None, :]
    if MASKED:
        ok = (rows < rows_left)[:, None, None] & ((chunks[None, :, None] * 2 + e[None, None, :] // 16) < nblocks_left)
        tl.store(out_ptr + offs, v, mask=ok)
    else:
        tl.store(out_ptr + offs, v)


@triton.jit
def nvfp4_quantize_kernel(
    x_ptr,       # [M, K] bf16/fp16/fp32, rows stride_xm apart, last dim contiguous
    data_ptr,    # [M, K // 8] int32 (the [M, K // 2] uint8 codes), contiguous: element 2j in the low nibble of byte j
    scales_ptr,  # [M, K // 16] uint8, contiguous: E4M3 bits of the block scales
    scale_ptr,   # [] fp32: the global scale g, or max |x| when DYNAMIC ([n_part] partial maxima: BLOCK_P > 1)
    gs_out_ptr,  # [] fp32: receives g when DYNAMIC (untouched otherwise)
    M, K, stride_xm, n_part,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    DYNAMIC: tl.constexpr, SM86: tl.constexpr, EMULATE_FMA: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Quantize x to NVFP4 (E2M1 codes, one E4M3 scale per 16 elements, an fp32 global scale g).

    Grid: (cdiv(M, BLOCK_M), cdiv(K, BLOCK_K)); BLOCK_K >= 32. One program quantizes the tile
    x[BLOCK_M rows, BLOCK_K columns], i.e. BLOCK_M x BLOCK_K/16 blocks, and writes
    data[those rows, BLOCK_K/8 words] and scales[those rows, BLOCK_K/16] (:func:`_quantize_program`).
    Per block: scale = e4m3(clamp(amax_b / (6 g), 2**-9, 448)), 1.0 when amax_b is 0; each
    element's code = e2m1(x / (fp32(scale) * g)).
    DYNAMIC: scale_ptr holds amax (BLOCK_P > 1: ``absmax_kernel``'s n_part partial maxima) and
    every program derives the same g = amax / 2688 from it (a correctly rounded division, as
    ``fp4moe.quantize`` does on every device); program (0, 0) stores g. SM86: the target has ``max.xorsign.abs.bf16x2`` (block maxima of bf16 in fewer
    instructions). EMULATE_FMA: exact fused multiply-adds for the interpreter.

    Offsets inside a tile are int32; only the tile's base offset is int64. Tiles that end
    inside K, and all tiles when K is not a multiple of 32 (rows of codes then do not start on
    16 bytes), take the masked variant; the others store 16-byte code words and 2-byte scales.
    """
    _quantize_program(x_ptr, data_ptr, scales_ptr, scale_ptr, gs_out_ptr, gs_out_ptr, gs_out_ptr, M, K, stride_xm,
                      0, 1, n_part, BLOCK_M, BLOCK_K, DYNAMIC, SM86, EMULATE_FMA, False, False, 1, BLOCK_P)


@triton.jit
def nvfp4_fake_quantize_kernel(
    x_ptr,       # [M, K] bf16/fp16/fp32, rows stride_xm apart, last dim contiguous
    out_ptr,     # [M, K] bf16 (rows stride_om apart): code value * block scale, without the global scales
    scale_ptr,   # [] fp32: the global scale g, or max |x| when DYNAMIC ([n_part] partial maxima: BLOCK_P > 1)
    wg_ptr,      # [G] fp32: the weight's global scales (HAS_WG; one, or one per expert), else unused
    g_out_ptr,   # [G] fp32: receives g * wg (or [1]: g)
    M, K, stride_xm, stride_om, G, n_part,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    DYNAMIC: tl.constexpr, SM86: tl.constexpr, EMULATE_FMA: tl.constexpr,
    HAS_WG: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """``nvfp4_quantize_kernel`` then ``nvfp4_dequantize_kernel`` in one pass, for the W4A4 path of
    GPUs without FP4 MMA: the same tiles, scales and codes, but each program writes its codes'
    values ``e2m1(code) * e4m3(scale)`` as bf16 (exact) instead of the codes, and program (0, 0)
    the product of the global scales for the GEMM's epilogue, as the dequantize kernel does. Bit
    for bit the two kernels' result, without the codes' round trip through memory and one launch
    fewer; PDL: waits for the kernel before it, then lets the GEMM after it launch."""
    pdl_enter(PDL)
    _quantize_program(x_ptr, out_ptr, out_ptr, scale_ptr, g_out_ptr, wg_ptr, g_out_ptr, M, K, stride_xm,
                      stride_om, G, n_part, BLOCK_M, BLOCK_K, DYNAMIC, SM86, EMULATE_FMA, True, HAS_WG, BLOCK_G,
                      BLOCK_P)


@triton.jit
def _quantize_program(x_ptr, dst_ptr, scales_ptr, scale_ptr, gs_out_ptr, wg_ptr, g_out_ptr, M, K, stride_xm,
                      stride_om, G, n_part, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DYNAMIC: tl.constexpr,
                      SM86: tl.constexpr, EMULATE_FMA: tl.constexpr, FAKE: tl.constexpr, HAS_WG: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr):
    """One program of either kernel: the tile x[BLOCK_M rows, BLOCK_K columns] of program
    (pid_m, pid_k), quantized and stored as codes and scales (dst_ptr: int32 words, scales_ptr), or
    FAKE as their bf16 values (dst_ptr: rows stride_om apart) with program (0, 0) storing g * wg to
    g_out_ptr (gs_out_ptr then unused)."""
    tl.static_assert(BLOCK_K % 32 == 0)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    row0 = pid_m * BLOCK_M
    rows_left = M - row0
    nblocks_left = K // 16 - pid_k * (BLOCK_K // 16)
    x_tile = x_ptr + row0.to(tl.int64) * stride_xm + pid_k * BLOCK_K
    full = (K % 32 == 0) & (nblocks_left >= BLOCK_K // 16) & (rows_left >= BLOCK_M)
    words_per_row = K // 8
    scales_per_row = K // 16
    # each of the four paths (full or masked tile, fast or exact divisions) loads, quantizes and stores
    # on its own: one straight-line path per case (sharing the quantization after a merge costs the
    # 64-register quantizer 8-52 more bytes of spills)
    if full:
        # the tile's loads go out before anything waits on g (one memory round trip per program, not two)
        r0, r1, r2, r3 = _load_tile(x_tile, rows_left, nblocks_left, stride_xm, BLOCK_M, BLOCK_K, False)
        g = _global_scale(scale_ptr, gs_out_ptr, (pid_m == 0) & (pid_k == 0), n_part, DYNAMIC, not FAKE, BLOCK_P)
        words_per_row = tl.multiple_of(words_per_row, 4)  # K % 32 == 0: rows start on 16 bytes
        scales_per_row = tl.multiple_of(scales_per_row, 2)
        dst_tile, scales_tile = _tile_pointers(dst_ptr, scales_ptr, row0, pid_k, words_per_row, scales_per_row,
                                               stride_om, BLOCK_K, FAKE)
        # Fast path, all in the normal range: divisions by reciprocals (2**-91 <= g <= 2**100).
        if _fast_range(g):
            _quantize_store(r0, r1, r2, r3, g, dst_tile, scales_tile, rows_left, nblocks_left,
                            words_per_row, scales_per_row, stride_om, WORDS=x_ptr.dtype.element_ty == tl.bfloat16,
                            BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, MASKED=False, FAST=True, SM86=SM86,
                            EMULATE_FMA=EMULATE_FMA, FAKE=FAKE)
        else:
            _quantize_store(r0, r1, r2, r3, g, dst_tile, scales_tile, rows_left, nblocks_left,
                            words_per_row, scales_per_row, stride_om, WORDS=x_ptr.dtype.element_ty == tl.bfloat16,
                            BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, MASKED=False, FAST=False, SM86=SM86,
                            EMULATE_FMA=EMULATE_FMA, FAKE=FAKE)
    else:
        g = _global_scale(scale_ptr, gs_out_ptr, (pid_m == 0) & (pid_k == 0), n_part, DYNAMIC, not FAKE, BLOCK_P)
        dst_tile, scales_tile = _tile_pointers(dst_ptr, scales_ptr, row0, pid_k, words_per_row, scales_per_row,
                                               stride_om, BLOCK_K, FAKE)
        if _fast_range(g):
            r0, r1, r2, r3 = _load_tile(x_tile, rows_left, nblocks_left, stride_xm, BLOCK_M, BLOCK_K, True)
            _quantize_store(r0, r1, r2, r3, g, dst_tile, scales_tile, rows_left, nblocks_left,
                            words_per_row, scales_per_row, stride_om, WORDS=x_ptr.dtype.element_ty == tl.bfloat16,
                            BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, MASKED=True, FAST=True, SM86=SM86,
                            EMULATE_FMA=EMULATE_FMA, FAKE=FAKE)
        else:
            r0, r1, r2, r3 = _load_tile(x_tile, rows_left, nblocks_left, stride_xm, BLOCK_M, BLOCK_K, True)
            _quantize_store(r0, r1, r2, r3, g, dst_tile, scales_tile, rows_left, nblocks_left,
                            words_per_row, scales_per_row, stride_om, WORDS=x_ptr.dtype.element_ty == tl.bfloat16,
                            BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, MASKED=True, FAST=False, SM86=SM86,
                            EMULATE_FMA=EMULATE_FMA, FAKE=FAKE)
    if FAKE:
        if (pid_m == 0) & (pid_k == 0):
            g = _global_scale(scale_ptr, gs_out_ptr, False, n_part, DYNAMIC, False, BLOCK_P)
            if HAS_WG:  # BLOCK_G >= G
                offs = tl.arange(0, BLOCK_G)
                tl.store(g_out_ptr + offs, g * tl.load(wg_ptr + offs, mask=offs < G, other=0.0), mask=offs < G)
            else:
                tl.store(g_out_ptr, g)


@triton.jit
def _tile_pointers(dst_ptr, scales_ptr, row0, pid_k, words_per_row, scales_per_row, stride_om,
                   BLOCK_K: tl.constexpr, FAKE: tl.constexpr):
    """Where program (row0, pid_k)'s tile goes: its code words and scales, or FAKE its bf16 values
    (the second pointer then unused)."""
    if FAKE:
        return dst_ptr + row0.to(tl.int64) * stride_om + pid_k * BLOCK_K, scales_ptr
    else:
        return (dst_ptr + row0.to(tl.int64) * words_per_row + pid_k * (BLOCK_K // 8),
                scales_ptr + row0.to(tl.int64) * scales_per_row + pid_k * (BLOCK_K // 16))


@triton.jit
def _quantize_store(r0, r1, r2, r3, g, dst_tile, scales_tile, rows_left, nblocks_left, words_per_row,
                    scales_per_row, stride_om, WORDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    MASKED: tl.constexpr, FAST: tl.constexpr, SM86: tl.constexpr, EMULATE_FMA: tl.constexpr,
                    FAKE: tl.constexpr):
    """:func:`_quantize_loaded` on a loaded tile, then its codes (:func:`_store_codes`) or, FAKE,
    their values (:func:`_store_values`) stored at the tile's pointers (:func:`_tile_pointers`)."""
    words, s_a, s_b = _quantize_loaded(r0, r1, r2, r3, g, WORDS, BLOCK_M, BLOCK_K, FAST, SM86, EMULATE_FMA)
    if FAKE:
        _store_values(words, s_a, s_b, dst_tile, rows_left, nblocks_left, stride_om, MASKED)
    else:
        _store_codes(words, s_a, s_b, dst_tile, scales_tile, rows_left, nblocks_left, words_per_row,
                     scales_per_row, MASKED)


@triton.jit
def _global_scale(scale_ptr, gs_out_ptr, first, n_part, DYNAMIC: tl.constexpr, STORE: tl.constexpr,
                  BLOCK_P: tl.constexpr):
    """g from scale_ptr; DYNAMIC: scale_ptr holds amax (BLOCK_P > 1: the n_part <= BLOCK_P partial
    maxima of ``absmax_kernel``'s PARTIALS, reduced here as the atomics would: an integer maximum of
    their bits), g = amax / (6 * 448) (correctly rounded), 1.0 when amax is 0, and with STORE the
    ``first`` program stores it to gs_out_ptr."""
    if DYNAMIC and BLOCK_P > 1:
        offs = tl.arange(0, BLOCK_P)
        part = tl.load(scale_ptr.to(tl.pointer_type(tl.int32)) + offs, mask=offs < n_part, other=0)
        g = tl.max(part, axis=0).to(tl.float32, bitcast=True)
    else:
        g = tl.load(scale_ptr)
    if DYNAMIC:
        g = tl.where(g > 0, tl.math.div_rn(g, 2688.0), 1.0)
        if STORE:
            if first:
                tl.store(gs_out_ptr, g)
    return g


@triton.jit
def _fast_range(g):
    """2**-91 <= g <= 2**100: the range where the divisions by reciprocals are exact (module docstring)."""
    return (g >= 4.0389678347315804e-28) & (g <= 1.2676506002282294e30)


@triton.jit
def nvfp4_weight_dequantize_kernel(
    data_ptr,    # [N * K // 2] uint8 codes of a contiguous weight [N, K]: element 2j in the low nibble of byte j
    scales_ptr,  # [N * K // 16] uint8 E4M3 bits of its block scales, contiguous
    out_ptr,     # [N * K // 2] int32 view of the bf16 output [N, K]: code value * block scale, no global scale
    n_bytes,     # N * K // 2
    BLOCK: tl.constexpr,  # bytes per program
    PDL: tl.constexpr,
):
    """A contiguous NVFP4 weight to bf16 for ``ops.linear``'s large-batch path: as
    ``nvfp4_dequantize_kernel`` (the same exact values) but over the flat arrays, each program one
    run of ``BLOCK`` bytes: with K a multiple of 16, byte f's block scale is scale f // 8 of the
    flat scales, so no index is per row. Byte f's two values are output elements 2f (low nibble)
    and 2f + 1: one 32-bit word, stored in the bytes' own layout (no shuffle between threads)."""
    pdl_enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_bytes
    b = tl.load(data_ptr + offs, mask=ok, other=0)
    s = e4m3_to_f32(tl.load(scales_ptr + offs // 8, mask=ok, other=0))
    lo = (e2m1_to_f32(b & 0xF) * s).to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
    hi = (e2m1_to_f32(b >> 4) * s).to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
    tl.store(out_ptr + offs, (lo | (hi << 16)).to(tl.int32, bitcast=True), mask=ok)


@triton.jit
def nvfp4_dequantize_kernel(
    data_ptr,    # [M, K // 2] uint8 codes (rows stride_dm apart): element 2j in the low nibble of byte j
    scales_ptr,  # [M, K // 16] uint8 E4M3 bits of the block scales (rows stride_sm apart)
    xg_ptr,      # [] fp32: the activations' global scale
    wg_ptr,      # [G] fp32: the weight's global scales (HAS_WG; one, or one per expert), else unused
    out_ptr,     # [M, K_OUT] bf16 (rows stride_om apart): code value * block scale, without the global scales
    g_out_ptr,   # [G] fp32: receives xg * wg (or [1]: xg)
    M, K, K_OUT, stride_dm, stride_sm, stride_om, G,
    BLOCK_K: tl.constexpr, HAS_WG: tl.constexpr, BLOCK_G: tl.constexpr, MMA_ORDER: tl.constexpr,
    PDL: tl.constexpr,
):
    """NVFP4 activations back to bf16 for the W4A4 path on GPUs without FP4 MMA: each element
    becomes ``e2m1(code) * e4m3(scale)``, which has at most 6 significant bits (2 times 4) and
    lies in [2**-10, 2688], so bf16 (8 bits) holds it exactly; the global scales are left out and their product
    goes to ``g_out_ptr`` for the GEMM's epilogue. The GEMM on these values with fp32
    accumulation is then the product of the two dequantized operands that the native FP4 MMA
    computes, with the two global scales applied once at the end.

    MMA_ORDER: each row is written in the packed weights' K order for the wgmma kernel's TMA loads
    (what ``mma_order_rows`` would make of it, K_OUT a multiple of 64 >= K, zeros past K); else
    K_OUT = K in x's order. Grid: (M, cdiv(K_OUT, BLOCK_K)), one row per program; K a multiple of 16."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    if MMA_ORDER:  # output column c holds element 2 stored_pair(c // 2) + c % 2
        src = 2 * stored_pair(cols // 2) + cols % 2
    else:
        src = cols
    ok = (src < K) & (pid_m < M)  # M = 0 runs one program, for g
    row = pid_m.to(tl.int64)
    # per element: its byte (each read by two neighbouring elements) and its block's scale (16), one
    # row per program so that every tensor keeps one layout (no conversion through shared memory)
    codes = tl.load(data_ptr + row * stride_dm + src // 2, mask=ok, other=0)
    codes = (codes >> ((src % 2) * 4).to(tl.uint8)) & 0xF
    sbits = tl.load(scales_ptr + row * stride_sm + src // 16, mask=ok, other=0)
    v = (e2m1_to_f32(codes) * e4m3_to_f32(sbits)).to(tl.bfloat16)  # 0 where masked: K padding
    tl.store(out_ptr + row * stride_om + cols, v, mask=(cols < K_OUT) & (pid_m < M))
    if (pid_m == 0) & (pid_k == 0):
        g = tl.load(xg_ptr)
        if HAS_WG:  # BLOCK_G >= G
            offs = tl.arange(0, BLOCK_G)
            tl.store(g_out_ptr + offs, g * tl.load(wg_ptr + offs, mask=offs < G, other=0.0), mask=offs < G)
        else:
            tl.store(g_out_ptr, g)
