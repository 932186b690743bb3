"""Expert-grouped FP4 GEMMs of the MoE layer.

Rows are token-expert pairs sorted by expert (``ops.dispatch``); a *tile* is up to BLOCK_M rows
of one expert. Like the linear kernel, each program computes the transposed product
``out^T[n-tile, rows] = W_e[n-tile, :] @ X[rows, :]^T`` so the expert's weight tile is the large
MMA operand and decode-time experts with 1-2 tokens still spread their weights over many
programs (grid axis 0 runs over N).

GEMM 1 (``SWIGLU`` > 0): for output column j the program accumulates the gate row and the up
row of W13 (rows j and I + j, or 2j and 2j + 1 when the checkpoint interleaves them, as gpt-oss
does) and applies the activation in the epilogue: silu(g) * u, or gpt-oss's
clamp(g, max=7) * sigmoid(1.702 g) * (clamp(u, -7, 7) + 1) (GPT_OSS_LIMIT, GPT_OSS_ALPHA).
GEMM 2: the routing weight of each row is multiplied in the epilogue and the row is written at
its pair index (t * top_k + slot), so the combine can sum each token's rows in slot order.
"""

import triton
import triton.language as tl

from .fp4_decode import decode_fp4_tile, decode_fp4_tile_fast
from .pdl import pdl_enter

#: gpt-oss's clamped SwiGLU, clamp(g, max=LIMIT) * sigmoid(ALPHA g) * (clamp(u, -LIMIT, LIMIT) + 1): the
#: one definition (the reference in ops.moe and the wgmma kernel's constexprs read these)
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0
_ALPHA = tl.constexpr(GPT_OSS_ALPHA)
_LIMIT = tl.constexpr(GPT_OSS_LIMIT)


@triton.jit
def _load_weight_rows(w_ptr, ws_ptr, rows, row_mask, k0, k_end, offs_kb, offs_kw, stride_wn, stride_wsn,
                      GROUP: tl.constexpr):
    """Packed bytes [R, BLOCK_K/2] and scale bytes [R, BLOCK_K/GROUP] of weight rows ``rows`` at step k0."""
    kb = k0 // 2 + offs_kb
    kw = k0 // GROUP + offs_kw
    w = tl.load(w_ptr + rows[:, None] * stride_wn + kb[None, :], mask=row_mask[:, None] & (kb < k_end // 2)[None, :],
                other=0)
    ws = tl.load(ws_ptr + rows[:, None] * stride_wsn + kw[None, :],
                 mask=row_mask[:, None] & (kw < k_end // GROUP)[None, :], other=0)
    return w, ws


@triton.jit
def _weight_rows_dot(acc, w_ptr, ws_ptr, rows, row_mask, xt, k0, k_end, offs_kb, offs_kw,
                     stride_wn, stride_wsn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                     W_E4M3: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, FAST_DECODE: tl.constexpr):
    """acc += decode(W[rows, k0:k0+BLOCK_K]) @ xt  (xt: [BLOCK_K, BLOCK_M])."""
    w, ws = _load_weight_rows(w_ptr, ws_ptr, rows, row_mask, k0, k_end, offs_kb, offs_kw, stride_wn, stride_wsn,
                              GROUP)
    if FAST_DECODE:
        wd = decode_fp4_tile_fast(w, ws, BLOCK_N, BLOCK_K, GROUP, W_E4M3)
    else:
        wd = decode_fp4_tile(w, ws, BLOCK_N, BLOCK_K, GROUP, W_E4M3, COMPUTE_DTYPE)
    return tl.dot(wd, xt, acc)


@triton.jit
def _weight_rows_dot_scaled(acc, w_ptr, ws_ptr, rows, row_mask, xq, xs, k0, k_end, offs_kb, offs_kw,
                            stride_wn, stride_wsn, GROUP: tl.constexpr, W_E4M3: tl.constexpr):
    """acc += W[rows, k-step] @ X^T with native block-scaled FP4 MMA (SM100/SM120 only)."""
    w, ws = _load_weight_rows(w_ptr, ws_ptr, rows, row_mask, k0, k_end, offs_kb, offs_kw, stride_wn, stride_wsn,
                              GROUP)
    if W_E4M3:
        ws = ws.to(tl.float8e4nv, bitcast=True)
    return tl.dot_scaled(w, ws, "e2m1", tl.trans(xq), xs.to(tl.float8e4nv, bitcast=True), "e2m1", acc)


@triton.jit
def moe_gemm_kernel(
    x_ptr,  # [rows of x, K] bf16/fp16 (stride_xm, 1): tokens (GEMM 1, gathered) or h rows (GEMM 2);
    # ACT 1/2: [rows of x, K/2] uint8 packed NVFP4
    xs_ptr,  # ACT 1/2: [rows of x, K/16] uint8 E4M3 scales (stride_xsm, 1); unused otherwise
    xg_ptr,  # ACT 1/2: [1] fp32 activation global scale; unused otherwise
    w_ptr,  # [E, N_w, K/2] uint8 packed expert weights (stride_we, stride_wn, 1)
    ws_ptr,  # [E, N_w, K/GROUP] uint8 scales (stride_wse, stride_wsn, 1)
    wg_ptr,  # fp32 weight global scales: [E] (WG_MODE 1, per expert) or [E, N_w] (WG_MODE 2, per row)
    bias_ptr,  # [E, N_w] per-expert bias (HAS_BIAS) or unused (stride_be)
    row_x_ptr,  # [R] int32: x row of each sorted row (GATHER) or unused
    row_out_ptr,  # [R] int32: output row of each sorted row (SCATTER) or unused
    row_w_ptr,  # fp32 routing weights: HAS_RW 1 [R] per sorted row, 2 [T * k] per pair (SCATTER: at the output row)
    tile_expert_ptr,  # [max_tiles] int32 expert of each tile, -1 for unused tiles
    tile_start_ptr,  # [max_tiles] int32 first sorted row of each tile
    tile_end_ptr,  # [max_tiles] int32 one past its last row
    out_ptr,  # [rows of out, N_out] (stride_om, 1)
    N_out, K, I_half,  # output columns; reduction length; GEMM 1: offset of the up rows (= N_out)
    stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ge, stride_be, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    W_E4M3: tl.constexpr, SWIGLU: tl.constexpr, INTERLEAVED: tl.constexpr, GATHER: tl.constexpr,
    SCATTER: tl.constexpr, HAS_RW: tl.constexpr, WG_MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, FAST_DECODE: tl.constexpr,
    ACT: tl.constexpr,  # 0 bf16/fp16 activations; 1 NVFP4 decoded in-kernel; 2 NVFP4 native (dot_scaled)
    FOLD: tl.constexpr,  # power of two to multiply the accumulator by (ops._runtime.fast_fold)
):
    """Grid (cdiv(N_out, BLOCK_N), max_tiles). One program: BLOCK_N output columns of one tile of
    rows of one expert, over all of K. Programs of unused tiles (expert -1) return at once."""
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_t)
    if e < 0:
        return
    start = tl.load(tile_start_ptr + pid_t)
    end = tl.load(tile_end_ptr + pid_t)
    rows = start + tl.arange(0, BLOCK_M)
    r_mask = rows < end
    if GATHER:
        x_rows = tl.load(row_x_ptr + rows, mask=r_mask, other=0)
    else:
        x_rows = rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = cols < N_out
    # the weight rows this program reads: GEMM 1 takes the gate rows and the up rows of its
    # columns as one [2 * BLOCK_N]-row tile (one MMA; two dot_scaled in one loop break Triton 3.6
    # on SM100), GEMM 2 just its columns
    gate_rows, up_rows = _gate_up_rows(cols, I_half, SWIGLU, INTERLEAVED)
    if SWIGLU > 0:
        w_rows = tl.reshape(tl.trans(tl.join(gate_rows, up_rows)), (2 * BLOCK_N,))
        w_mask = tl.reshape(tl.trans(tl.join(c_mask, c_mask)), (2 * BLOCK_N,))
        ROWS: tl.constexpr = 2 * BLOCK_N
    else:
        w_rows = cols
        w_mask = c_mask
        ROWS: tl.constexpr = BLOCK_N
    w_e = w_ptr + e.to(tl.int64) * stride_we
    ws_e = ws_ptr + e.to(tl.int64) * stride_wse
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_kw = tl.arange(0, BLOCK_K // GROUP)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kx = tl.arange(0, BLOCK_K // 16)
    acc = tl.zeros((ROWS, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if ACT == 0:
            kk = k0 + offs_k
            xt = tl.load(x_ptr + x_rows[None, :].to(tl.int64) * stride_xm + kk[:, None],
                         mask=r_mask[None, :] & (kk < K)[:, None], other=0.0).to(COMPUTE_DTYPE)  # [BLOCK_K, BLOCK_M]
            acc = _weight_rows_dot(acc, w_e, ws_e, w_rows, w_mask, xt, k0, K, offs_kb, offs_kw, stride_wn,
                                   stride_wsn, ROWS, BLOCK_K, GROUP, W_E4M3, COMPUTE_DTYPE, FAST_DECODE)
        else:
            kb = k0 // 2 + offs_kb
            kx = k0 // 16 + offs_kx
            xq = tl.load(x_ptr + x_rows[:, None].to(tl.int64) * stride_xm + kb[None, :],
                         mask=r_mask[:, None] & (kb < K // 2)[None, :], other=0)  # [BLOCK_M, BLOCK_K/2]
            xs = tl.load(xs_ptr + x_rows[:, None].to(tl.int64) * stride_xsm + kx[None, :],
                         mask=r_mask[:, None] & (kx < K // 16)[None, :], other=0)  # [BLOCK_M, BLOCK_K/16]
            if ACT == 1:
                if FAST_DECODE:
                    xt = tl.trans(decode_fp4_tile_fast(xq, xs, BLOCK_M, BLOCK_K, 16, True))
                else:
                    xt = tl.trans(decode_fp4_tile(xq, xs, BLOCK_M, BLOCK_K, 16, True, COMPUTE_DTYPE))
                acc = _weight_rows_dot(acc, w_e, ws_e, w_rows, w_mask, xt, k0, K, offs_kb, offs_kw, stride_wn,
                                       stride_wsn, ROWS, BLOCK_K, GROUP, W_E4M3, COMPUTE_DTYPE, FAST_DECODE)
            else:
                acc = _weight_rows_dot_scaled(acc, w_e, ws_e, w_rows, w_mask, xq, xs, k0, K, offs_kb, offs_kw,
                                              stride_wn, stride_wsn, GROUP, W_E4M3)
    if SWIGLU > 0:
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
    else:
        acc_g = acc
        acc_u = acc

    scale = FOLD  # the power of two the fast decoder leaves on its products (launcher: fast_fold)
    if ACT != 0:
        scale = scale * tl.load(xg_ptr)
    _moe_epilogue(acc_g, acc_u, scale, e, rows, r_mask, cols, c_mask, gate_rows, up_rows, wg_ptr, bias_ptr,
                  row_w_ptr, row_out_ptr, out_ptr, stride_ge, stride_be, stride_om,
                  SWIGLU, WG_MODE, HAS_BIAS, HAS_RW, SCATTER)


@triton.jit
def moe_partials_epilogue_kernel(
    part_ptr,  # [SPLIT, R, N_w] fp32 partial sums of W_e @ x^T per sorted row (kernels.linear_mma, grouped)
    wg_ptr, bias_ptr, row_out_ptr, row_w_ptr,  # as moe_gemm_kernel
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    out_ptr,  # as moe_gemm_kernel
    R, N_w, N_out, I_half, stride_ge, stride_be, stride_om,
    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SWIGLU: tl.constexpr,
    INTERLEAVED: tl.constexpr, SCATTER: tl.constexpr, HAS_RW: tl.constexpr, WG_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    """Grid (cdiv(N_out, BLOCK_N), max_tiles): the epilogue of ``moe_gemm_kernel`` (globals, bias,
    activation, routing weight, scatter) on partial sums another kernel wrote, added in split
    order (deterministic). Programs of unused tiles return at once."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_t)
    if e < 0:
        return
    rows = tl.load(tile_start_ptr + pid_t) + tl.arange(0, BLOCK_M)
    r_mask = rows < tl.load(tile_end_ptr + pid_t)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = cols < N_out
    gate_rows, up_rows = _gate_up_rows(cols, I_half, SWIGLU, INTERLEAVED)
    mask = c_mask[:, None] & r_mask[None, :]
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        base = part_ptr + (s * R + rows[None, :]).to(tl.int64) * N_w
        acc_g += tl.load(base + gate_rows[:, None], mask=mask, other=0.0)
        if SWIGLU > 0:
            acc_u += tl.load(base + up_rows[:, None], mask=mask, other=0.0)
    _moe_epilogue(acc_g, acc_u, 1.0, e, rows, r_mask, cols, c_mask, gate_rows, up_rows, wg_ptr, bias_ptr,
                  row_w_ptr, row_out_ptr, out_ptr, stride_ge, stride_be, stride_om,
                  SWIGLU, WG_MODE, HAS_BIAS, HAS_RW, SCATTER)


@triton.jit
def _gate_up_rows(cols, I_half, SWIGLU: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Weight rows of output columns ``cols``: GEMM 1 (SWIGLU > 0) the gate and the up row (rows j and
    I + j, or 2j and 2j + 1 when interleaved); GEMM 2 the column itself (twice)."""
    if SWIGLU > 0:
        if INTERLEAVED:
            return 2 * cols, 2 * cols + 1
        return cols, I_half + cols
    return cols, cols


@triton.jit
def _moe_epilogue(acc_g, acc_u, scale, e, rows, r_mask, cols, c_mask, gate_rows, up_rows, wg_ptr, bias_ptr,
                  row_w_ptr, row_out_ptr, out_ptr, stride_ge, stride_be, stride_om,
                  SWIGLU: tl.constexpr, WG_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RW: tl.constexpr,
                  SCATTER: tl.constexpr):
    """Global scales (``scale`` times the expert's or each row's), bias, activation, routing weight,
    then the store (at the pair row when SCATTER) of a [BLOCK_N, BLOCK_M] tile of one expert."""
    if WG_MODE == 1:
        scale = scale * tl.load(wg_ptr + e)
    g = acc_g * scale
    if WG_MODE == 2:  # each weight row has its own global (gate and up quantized separately)
        g = g * tl.load(wg_ptr + e.to(tl.int64) * stride_ge + gate_rows, mask=c_mask, other=0.0)[:, None]
    if HAS_BIAS:
        b_e = bias_ptr + e.to(tl.int64) * stride_be
        g += tl.load(b_e + gate_rows, mask=c_mask, other=0.0).to(tl.float32)[:, None]
    if SWIGLU > 0:
        u = acc_u * scale
        if WG_MODE == 2:
            u = u * tl.load(wg_ptr + e.to(tl.int64) * stride_ge + up_rows, mask=c_mask, other=0.0)[:, None]
        if HAS_BIAS:
            u += tl.load(b_e + up_rows, mask=c_mask, other=0.0).to(tl.float32)[:, None]
        if SWIGLU == 1:  # silu(g) * u
            res = g / (1.0 + tl.exp(-g)) * u
        else:  # gpt-oss (GPT_OSS_ALPHA, GPT_OSS_LIMIT)
            g = tl.minimum(g, _LIMIT)
            u = tl.minimum(tl.maximum(u, -_LIMIT), _LIMIT)
            res = g / (1.0 + tl.exp(-_ALPHA * g)) * (u + 1.0)
    else:
        res = g
    if HAS_RW == 1:  # the routing weight of each sorted row
        res = res * tl.load(row_w_ptr + rows, mask=r_mask, other=0.0)[None, :]
    if SCATTER:
        out_rows = tl.load(row_out_ptr + rows, mask=r_mask, other=0)
    else:
        out_rows = rows
    if HAS_RW == 2:  # the routing weight of each pair: a scattered row's output row is its pair
        tl.static_assert(SCATTER, "HAS_RW == 2 reads the routing weight at the pair row: SCATTER only")
        res = res * tl.load(row_w_ptr + out_rows, mask=r_mask, other=0.0)[None, :]
    out = out_ptr + out_rows[None, :].to(tl.int64) * stride_om + cols[:, None]
    tl.store(out, res.to(out_ptr.dtype.element_ty), mask=c_mask[:, None] & r_mask[None, :])


@triton.jit
def _token_row(PDL: tl.constexpr, H, BLOCK_H: tl.constexpr):
    """The combines' start (grid (T, cdiv(H, BLOCK_H))): wait for the previous kernel, then this
    program's token, its columns of H, their mask and a zero fp32 sum."""
    pdl_enter(PDL)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    return tl.program_id(0), cols, cols < H, tl.zeros((BLOCK_H,), dtype=tl.float32)


@triton.jit
def _slot_expert(ids_ptr, p, E):
    """Pair ``p``'s expert (0 for a dropped slot, int64) and whether the slot is kept (an id in [0, E))."""
    e = tl.load(ids_ptr + p)
    kept = (e >= 0) & (e < E)
    return tl.where(kept, e, 0).to(tl.int64), kept


@triton.jit
def _store_token_row(acc, t, cols, mask, shared_ptr, out_ptr, stride_sm, stride_om, HAS_SHARED: tl.constexpr):
    """The combines' end: token t's summed slots (fp32 ``acc`` over ``cols``) plus its shared-expert
    row, stored in the output's dtype."""
    if HAS_SHARED:
        acc += tl.load(shared_ptr + t.to(tl.int64) * stride_sm + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def moe_partials_combine_kernel(
    part_ptr,  # [SPLIT, R, H] fp32 (or, SPLIT 1, bf16) partial sums of W_e @ h^T per sorted row (GEMM 2 of
    # kernels.linear_mma, grouped)
    wg_ptr, bias_ptr,  # GEMM 2's weight globals and bias, as moe_gemm_kernel
    row_w_ptr,  # [T * TOP_K] fp32 routing weight of each pair
    ids_ptr,  # [T, TOP_K] int32 expert ids; ids outside [0, E) are dropped slots (skipped)
    pair_row_ptr,  # [T * TOP_K] int32 sorted row of each pair (the dispatch plan's pair_row)
    shared_ptr,  # [T, H] shared-expert output (HAS_SHARED) or unused
    out_ptr,  # [T, H]
    R, H, E, stride_ge, stride_be, stride_sm, stride_om,
    TOP_K: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, WG_MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    """Grid (T, cdiv(H, BLOCK_H)): ``moe_partials_epilogue_kernel`` for GEMM 2 (globals, bias,
    routing weight) and ``moe_combine_kernel`` in one pass, so the per-pair rows never leave the
    registers: each pair's value is rounded as the two kernels round it (from its pair row, fp32 or
    bf16, in fp32) and the token's TOP_K values are added in slot order, then the shared expert."""
    t, cols, mask, acc = _token_row(PDL, H, BLOCK_H)
    # no branch per slot: the slots' loads are all in flight at once (a branch would serialise
    # TOP_K memory round trips); a dropped slot reads nothing and adds 0, as moe_combine_kernel
    for s in tl.static_range(TOP_K):
        p = t * TOP_K + s
        e, kept = _slot_expert(ids_ptr, p, E)
        row = tl.load(pair_row_ptr + p, mask=kept, other=0).to(tl.int64)
        m = mask & kept
        g = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for sp in tl.static_range(SPLIT):  # K splits in order, as moe_partials_epilogue_kernel
            g += tl.load(part_ptr + (sp * R + row) * H + cols, mask=m, other=0.0).to(tl.float32)
        if WG_MODE == 1:
            g = g * tl.load(wg_ptr + e, mask=kept, other=0.0)
        if WG_MODE == 2:
            g = g * tl.load(wg_ptr + e * stride_ge + cols, mask=m, other=0.0)
        if HAS_BIAS:
            g += tl.load(bias_ptr + e * stride_be + cols, mask=m, other=0.0).to(tl.float32)
        acc += g * tl.load(row_w_ptr + p, mask=kept, other=0.0)
    _store_token_row(acc, t, cols, mask, shared_ptr, out_ptr, stride_sm, stride_om, HAS_SHARED)


@triton.jit
def moe_combine_kernel(
    y_pair_ptr,  # [T * TOP_K, H] per-pair outputs (routing weight applied), row t * TOP_K + slot
    ids_ptr,  # [T, TOP_K] int32 expert ids; ids outside [0, E) are dropped slots (never computed, skipped)
    shared_ptr,  # [T, H] shared-expert output (HAS_SHARED) or unused
    out_ptr,  # [T, H]
    H, E, stride_pm, stride_sm, stride_om,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_SHARED: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    """Grid (T, cdiv(H, BLOCK_H)). One program sums the TOP_K rows of one token in slot order
    (deterministic: the same input gives bitwise the same output), plus the shared expert."""
    t, cols, mask, acc = _token_row(PDL, H, BLOCK_H)
    for s in tl.static_range(TOP_K):
        _, kept = _slot_expert(ids_ptr, t * TOP_K + s, E)
        acc += tl.load(y_pair_ptr + (t * TOP_K + s).to(tl.int64) * stride_pm + cols, mask=mask & kept,
                       other=0.0).to(tl.float32)
    _store_token_row(acc, t, cols, mask, shared_ptr, out_ptr, stride_sm, stride_om, HAS_SHARED)
