"""FP4 linear layer kernel: ``y[M, N] = x[M, K] @ W[N, K]^T`` with W in an FP4 format.

The kernel computes the transposed product ``y^T = W @ x^T`` ("swap AB"): the weight rows are
the MMA's M side and the tokens its N side. At decode time M (tokens) is 1..64 while N is in the
thousands, so the weight tile, decoded in registers, is the large operand (on Hopper it can feed
wgmma straight from registers) and the grid spreads N over every SM.

Activation paths (constexpr ``ACT``):
  0  W4A16: x is bf16/fp16; W decoded to x's dtype in registers; tensor-core MMA, fp32 accumulate.
  1  W4A4 emulated: x is NVFP4 (packed + E4M3 scales); both operands decoded to bf16 (exact:
     an E2M1 value times an E4M3 scale fits bf16), bf16 MMA. SM80-SM90 and the interpreter.
  2  W4A4 native: ``tl.dot_scaled`` block-scaled FP4 MMA (SM100 tcgen05, SM120 mma.sync
     kind::mxf4nvf4). Never used on SM90 or in the interpreter (REFERENCE.md).
Global scales are applied once in the fp32 epilogue.
"""

import triton
import triton.language as tl

from .fp4_decode import decode_fp4_tile, decode_fp4_tile_fast

ACT_BF16 = tl.constexpr(0)
ACT_FP4_EMULATED = tl.constexpr(1)
ACT_FP4_NATIVE = tl.constexpr(2)


@triton.jit
def fp4_linear_kernel(
    x_ptr,  # ACT 0: [M, K] bf16/fp16 (stride_xm, 1); ACT 1/2: [M, K/2] uint8 packed NVFP4
    xs_ptr,  # ACT 1/2: [M, K/16] uint8 E4M3 bits (stride_xsm, 1); unused otherwise
    xg_ptr,  # ACT 1/2: [1] fp32 activation global scale; unused otherwise
    w_ptr,  # [N, K/2] uint8 packed weights (stride_wn, 1)
    ws_ptr,  # [N, K/GROUP] uint8 weight scales (stride_wsn, 1)
    wg_ptr,  # [1] fp32 weight global scale (HAS_WG) or unused
    bias_ptr,  # [N] (HAS_BIAS) or unused
    y_ptr,  # SPLIT_K == 1: [M, N] output (stride_ym, 1); else [SPLIT_K, M, N] fp32 partial sums
    M, N, K,
    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_ym,
    k_per_split,  # K elements per split (a multiple of BLOCK_K)
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,  # weight scale block: 16 (NVFP4) or 32 (MXFP4)
    W_E4M3: tl.constexpr,  # weight scales are E4M3 (NVFP4) rather than E8M0 (MXFP4)
    ACT: tl.constexpr, HAS_WG: tl.constexpr, HAS_BIAS: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,  # MMA operand dtype: x's dtype (ACT 0) or bf16 (ACT 1); fp32 in the
    # interpreter, whose bf16 dot is wrong in Triton 3.6 (the decoded values are exact in either)
    SPLIT_K: tl.constexpr,
    FAST_DECODE: tl.constexpr,  # decode with inline PTX (compiled CUDA, bf16 operands); else portable Triton
    FOLD: tl.constexpr,  # power of two to multiply the accumulator by (ops._runtime.fast_fold)
):
    """Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K); one program computes the tile
    y[m-tile, n-tile] over its share of K. With SPLIT_K > 1 it writes fp32 partial sums (global
    scales applied) that ``splitk_reduce_kernel`` adds in a fixed order, with the bias."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    offs_kb = tl.arange(0, BLOCK_K // 2)  # packed bytes along K
    offs_kw = tl.arange(0, BLOCK_K // GROUP)  # weight scales along K
    offs_kx = tl.arange(0, BLOCK_K // 16)  # activation scales along K (NVFP4)
    offs_k = tl.arange(0, BLOCK_K)

    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    ws_rows = ws_ptr + offs_n[:, None].to(tl.int64) * stride_wsn
    rows_m = offs_m.to(tl.int64)  # M x N or M x K can pass 2**31 elements at long prefill
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        kb = k0 // 2 + offs_kb
        kw = k0 // GROUP + offs_kw
        w = tl.load(w_rows + kb[None, :], mask=n_mask[:, None] & (kb[None, :] < k_end // 2), other=0)
        ws = tl.load(ws_rows + kw[None, :], mask=n_mask[:, None] & (kw[None, :] < k_end // GROUP), other=0)
        if ACT == 0:
            kk = k0 + offs_k
            xt = tl.load(x_ptr + rows_m[None, :] * stride_xm + kk[:, None],
                         mask=m_mask[None, :] & (kk[:, None] < k_end), other=0.0)  # [BLOCK_K, BLOCK_M]
            xt = xt.to(COMPUTE_DTYPE)
            if FAST_DECODE:
                wd = decode_fp4_tile_fast(w, ws, BLOCK_N, BLOCK_K, GROUP, W_E4M3)
            else:
                wd = decode_fp4_tile(w, ws, BLOCK_N, BLOCK_K, GROUP, W_E4M3, COMPUTE_DTYPE)
            acc = tl.dot(wd, xt, acc)
        else:
            kx = k0 // 16 + offs_kx
            xq = tl.load(x_ptr + rows_m[:, None] * stride_xm + kb[None, :],
                         mask=m_mask[:, None] & (kb[None, :] < k_end // 2), other=0)  # [BLOCK_M, BLOCK_K/2]
            xs = tl.load(xs_ptr + rows_m[:, None] * stride_xsm + kx[None, :],
                         mask=m_mask[:, None] & (kx[None, :] < k_end // 16), other=0)  # [BLOCK_M, BLOCK_K/16]
            if ACT == 1:
                if FAST_DECODE:
                    wd = decode_fp4_tile_fast(w, ws, BLOCK_N, BLOCK_K, GROUP, W_E4M3)
                    xd = decode_fp4_tile_fast(xq, xs, BLOCK_M, BLOCK_K, 16, True)
                else:
                    wd = decode_fp4_tile(w, ws, BLOCK_N, BLOCK_K, GROUP, W_E4M3, COMPUTE_DTYPE)
                    xd = decode_fp4_tile(xq, xs, BLOCK_M, BLOCK_K, 16, True, COMPUTE_DTYPE)
                acc = tl.dot(wd, tl.trans(xd), acc)
            else:
                if W_E4M3:
                    ws_native = ws.to(tl.float8e4nv, bitcast=True)
                else:
                    ws_native = ws
                acc = tl.dot_scaled(w, ws_native, "e2m1", tl.trans(xq), xs.to(tl.float8e4nv, bitcast=True),
                                    "e2m1", acc)

    if FOLD != 1.0:  # the power of two the fast decoder leaves on its products (launcher: fast_fold)
        acc = acc * FOLD
    if HAS_WG:
        acc = acc * tl.load(wg_ptr)
    if ACT != 0:
        acc = acc * tl.load(xg_ptr)
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            acc = acc + bias[:, None]
        y = y_ptr + rows_m[None, :] * stride_ym + offs_n[:, None]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        part = y_ptr + (pid_k * M + rows_m[None, :]) * N + offs_n[:, None]
        tl.store(part, acc, mask=mask)


@triton.jit
def splitk_reduce_kernel(
    part_ptr,  # [SPLIT_K, M, N] fp32 partial sums
    bias_ptr,  # [N] (HAS_BIAS) or unused
    y_ptr,  # [M, N] output (stride_ym, 1)
    M, N, stride_ym,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Grid (M, cdiv(N, BLOCK)); one program sums the SPLIT_K partials of BLOCK outputs of one
    row in split order (deterministic), adds the bias and casts."""
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
