"""Prefill FP4 GEMM for Hopper (SM90): wgmma with the weights as the register operand (Gluon).

At prefill the tensor cores are the bound, and on SM90 only ``wgmma`` reaches them at full rate.
``wgmma`` takes its A operand from registers, with the same per-warp fragment layout as
``mma.sync.m16n8k16`` — the layout ``fp4moe.ops.mma_layout`` stores the weights in. So the
program's weight words for a 64-K chunk (16-row blocks of 128 int32, contiguous per block) and
their scale pairs arrive by TMA into a shared ring, each thread reads its own 16 bytes back and
decodes them (``mma_decode.decode_a_operand``: ~2 instructions per value, the layout conversion
asserted free) straight into the operand; the activations arrive by TMA on the same mbarrier
per ring stage, in the 128-byte swizzle wgmma reads as its B operand (weights and scales by TMA,
not by the decoding warps: docs/performance-engineering.md, ``gemm_wgmma`` ring).

Small batches (the plain linear at M <= 64): 16- to 64-row activation tiles, and the K chunks
split over grid axis 1 (``k_per_split`` each); each split writes its fp32 partial tile, which
``kernels.linear.splitk_reduce_kernel`` adds in split order (deterministic) with the bias.

Activations in MMA K order. The weights' K is permuted inside every 64-chunk (stored k = 16t +
4kl + 2i2 + i0 at MMA position 16kl + 8i2 + 2t + i0, see ``mma_layout``), so the B operand must
be too: ``mma_order_rows_kernel`` writes x in that order in one pass (gathering the rows of MoE
GEMM 1 on the way), and GEMM 1 writes h in GEMM 2's order directly (``OUT_MMA_ORDER``). The
TMA copies then move tiles as they are, with no address arithmetic of their own
(docs/performance-engineering.md, ``mma_order_rows_kernel``).

Pipelining and a Triton 3.6 hazard. One wgmma group stays in flight while the next chunk is
decoded, which needs the in-flight group's A registers left alone: Triton 3.6 does not ensure it
(triton-lang/triton#9433) and ptxas reused them for the next chunk's weight words (wrong rows).
What keeps them apart is the K loop unrolled by two: each half's operand lives in its own
registers, and each half's registers are redefined only after the wait that retires them. Each
operand also passes through a ``mov`` right before its wgmma: in the unrolled loop it changes no
instruction, but it is the form in which ptxas tracks the registers itself, so that if a future
change lets them collide again, ptxas serialises (it injected a full wait in the non-unrolled
build, ptxas info C7517) rather than corrupting. ``fp4moe.plan.sass.wgmma_register_hazards``
checks the SASS of the configurations the tests and the planner compile.

Persistent programs (plain linear, 256-row tiles, ``PERSISTENT``): one program per SM takes tiles
pid, pid + grid, ... and its ring runs on from one tile's chunks into the next one's, so that the
next tile's first chunks load while this one finishes and stores its output, where a program per
tile pays its launch, the ring's first loads and its stores' drain once per tile
(docs/performance-engineering.md, ``PERSISTENT``). The next tile's coordinates are computed once
per tile, not per chunk (integer divisions), and the epilogue's row indices pass through an
opaque ``mov`` so that the compiler does not hoist their offsets out of the tile loop (kept live
across it, they spilled ~300 local-memory operations per tile).

One program: 16 REPEATS WARPS weight rows (WARPS = 4 or 8 warps, one or two warpgroups, x 16 rows,
REPEATS = 1 or 2 times) x BLOCK_M rows of activations. With REPEATS = 1 a 256-row activation tile
fits the same 128 accumulator registers, and each decoded weight feeds twice as many MMA columns.
GROUPED with TAIL_M > 0: a tile of at most TAIL_M rows (an expert's short last tile) runs the
same code with TAIL_M-row wgmmas (``_gemm_tile`` is instantiated for both heights), so it costs
less than a nearly empty BLOCK_M tile and still follows its expert's first tile, whose weights it
reads again, while they are in L2. With MERGE_TAIL the full tile before such a short tile of the
same expert runs its rows instead (a second TAIL_M-row box in each ring stage, a second wgmma and
accumulator on the same decoded registers, both chunks' groups kept in flight), so the weights are
read and decoded once; the short tile's programs do nothing (docs/performance-engineering.md,
``MERGE_TAIL``). Epilogue (``kernels.moe._moe_epilogue``):
  plain linear: ``y[m, n] = acc * FOLD * global + bias`` (no MoE arguments);
  GROUPED (MoE, program axis over an ``ops.dispatch`` plan's tiles of one expert each):
    SWIGLU > 0 (GEMM 1): the rows are 16 WARPS gate rows then the matching up rows, so every
      thread holds a gate value and its up value in registers: the activation is applied in
      place and h [rows, I] written in bf16;
    SWIGLU == 0 (GEMM 2): routing weight per row, scattered to the pair row (``row_out``).
  Global scales per expert (WG_MODE 1) or per row (WG_MODE 2) and biases as ``kernels.moe``.
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .mma_decode import _pdl_enter, decode_a_operand
from .moe import _gate_up_rows, _moe_epilogue
from .pdl import pdl_enter



@triton.jit
def stored_pair(q):
    """The stored bf16 pair of K that MMA pair position ``q`` holds (``ops.mma_layout``'s K order:
    inside each 64-K chunk, MMA pair 8kl + 4i2 + t holds stored pair 8t + 2kl + i2)."""
    r = q % 32
    return q - r + 8 * (r % 4) + 2 * (r // 8) + (r // 4) % 2


@triton.jit
def mma_pair(s):
    """The inverse of ``stored_pair``: the MMA pair position of stored pair ``s``."""
    r = s % 32
    return s - r + 8 * ((r // 2) % 4) + 4 * (r % 2) + r // 8


@gluon.jit
def _load_chunk(cn, n_c, kc0, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, row_start, rb0, rb_up,
                NB: gl.constexpr, SWIGLU: gl.constexpr, x2_desc=None, x2_smem=None, PART: gl.constexpr = 0):
    """TMA copies of the program's chunk ``cn`` (K chunk kc0 + cn; nothing at or past n_c) into
    ring slot ``cn % STAGES`` (``_load_stage``)."""
    _load_stage(cn % x_smem.shape[0], cn < n_c, kc0 + cn, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready,
                row_start, rb0, rb_up, NB, SWIGLU, x2_desc, x2_smem, PART)


@gluon.jit
def _load_stage(slot, pred, kc, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, row_start, rb0, rb_up,
                NB: gl.constexpr, SWIGLU: gl.constexpr, x2_desc=None, x2_smem=None, PART: gl.constexpr = 0):
    """Where ``pred``, TMA copies of K chunk ``kc`` into ring slot ``slot`` on its mbarrier: the
    activation tile from ``row_start`` and the program's NB weight row blocks, words and scale pairs
    (16-row block b's at [b, chunk]: one box from rb0, or for GEMM 1 NB / 2 gate blocks from rb0
    and as many up blocks from rb_up). Blocks past the program's rows (N or I not a multiple of the
    tile) are the same expert's up rows (GEMM 1's gate box), the next expert's rows, or zeros past
    the tensor: they feed only accumulator rows whose columns are never stored. With ``x2_smem``
    (a tile that runs its expert's short last tile too), also the x2_desc box of activation rows
    that follows the first one. ``PART``: 0 all of it; 1 the expected bytes and the weights' copies,
    2 the activations' (a programmatic dependent launch requests its first weights before its wait)."""
    S: gl.constexpr = s_desc.block_type.shape[1]
    W_COPIES: gl.constexpr = 2 if SWIGLU > 0 else 1
    X_BYTES: gl.constexpr = x_desc.block_type.nbytes + (0 if x2_smem is None else x2_desc.block_type.nbytes)
    if PART != 2:
        mbarrier.expect(ready.index(slot), X_BYTES + W_COPIES * (w_desc.block_type.nbytes + s_desc.block_type.nbytes),
                        pred=pred)
    if PART != 1:
        tma.async_copy_global_to_shared(x_desc, [row_start, kc * 64], ready.index(slot), x_smem.index(slot),
                                        pred=pred)
        if x2_smem is not None:
            tma.async_copy_global_to_shared(x2_desc, [row_start + x_desc.block_type.shape[0], kc * 64],
                                            ready.index(slot), x2_smem.index(slot), pred=pred)
    if PART != 2:
        if SWIGLU > 0:
            tma.async_copy_global_to_shared(w_desc, [rb0, kc * 128], ready.index(slot),
                                            w_smem.index(slot).slice(0, NB // 2), pred=pred)
            tma.async_copy_global_to_shared(w_desc, [rb_up, kc * 128], ready.index(slot),
                                            w_smem.index(slot).slice(NB // 2, NB // 2), pred=pred)
            tma.async_copy_global_to_shared(s_desc, [rb0, kc * S], ready.index(slot),
                                            s_smem.index(slot).slice(0, NB // 2), pred=pred)
            tma.async_copy_global_to_shared(s_desc, [rb_up, kc * S], ready.index(slot),
                                            s_smem.index(slot).slice(NB // 2, NB // 2), pred=pred)
        else:
            tma.async_copy_global_to_shared(w_desc, [rb0, kc * 128], ready.index(slot), w_smem.index(slot), pred=pred)
            tma.async_copy_global_to_shared(s_desc, [rb0, kc * S], ready.index(slot), s_smem.index(slot), pred=pred)


@gluon.jit
def load_scales(s_slot, MXFP4: gl.constexpr, s_layout: gl.constexpr, WARPS: gl.constexpr):
    """One chunk's scale pairs [NB, S] from shared memory as the decode wants them, [NB, 1, 32] in
    ``s_layout`` (the pair of lane l, on WARPS warps): NVFP4 has one pair per 16 K (S = 32, lane l
    takes pair l), MXFP4 one per 32 K (S = 16, lane l takes pair l // 2)."""
    NB: gl.constexpr = s_slot.shape[0]
    if MXFP4:
        s16_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[1, 32],
                                                    warps_per_cta=[WARPS, 1], order=[1, 0])
        s16 = s_slot.load(s16_layout)
        s = gl.convert_layout(gl.reshape(gl.join(s16, s16), [NB, 1, 32]), s_layout)
    else:
        s = s_slot.reshape([NB, 1, 32]).load(s_layout)
    return s


@gluon.jit
def _k_step(c, n_c, kc0, acc, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, row_start, rb0, rb_up,
            STAGES: gl.constexpr, WARPS: gl.constexpr, NB: gl.constexpr, SWIGLU: gl.constexpr,
            MXFP4: gl.constexpr, DECODE: gl.constexpr, SCALE: gl.constexpr, a_layout: gl.constexpr,
            w_layout: gl.constexpr, x2_desc=None, x2_smem=None, acc2=None):
    """The program's chunk c (K chunk kc0 + c): refill the buffers chunk c-2 used (every warpgroup
    is past chunk c-1's wait, so c-2's wgmma is done and its weight words and scales are read
    everywhere) with chunk c + STAGES - 2, then ``_mma_stage`` on chunk c."""
    gl.thread_barrier()
    _load_chunk(c + STAGES - 2, n_c, kc0, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, row_start, rb0,
                rb_up, NB, SWIGLU, x2_desc, x2_smem)
    return _mma_stage(c % STAGES, (c // STAGES) & 1, acc, x_smem, w_smem, s_smem, ready, WARPS, NB, MXFP4, DECODE,
                      SCALE, a_layout, w_layout, x2_smem, acc2)


@gluon.jit
def _mma_stage(slot, phase, acc, x_smem, w_smem, s_smem, ready, WARPS: gl.constexpr, NB: gl.constexpr,
               MXFP4: gl.constexpr, DECODE: gl.constexpr, SCALE: gl.constexpr, a_layout: gl.constexpr,
               w_layout: gl.constexpr, x2_smem=None, acc2=None):
    """Wait for ring slot ``slot`` (its ``phase``), decode its weights into the A operand and issue
    its wgmma, keeping one chunk's in flight. With ``x2_smem`` the same operand also multiplies the
    slot's second activation box into ``acc2`` (a merged tail: two wgmmas per chunk, both kept in
    flight, on the same registers), and the pair (acc, acc2) is returned."""
    mbarrier.wait(ready.index(slot), phase)
    w = w_smem.index(slot).reshape([NB, 1, 32, 4]).load(w_layout)
    s = load_scales(s_smem.index(slot), MXFP4, gl.SliceLayout(3, w_layout), WARPS)
    wd = decode_a_operand(w, s, NB, 1, DECODE, SCALE, a_layout)
    wd = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [wd], dtype=gl.bfloat16, is_pure=False, pack=2)
    acc = warpgroup_mma(wd, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
    if x2_smem is None:
        acc = warpgroup_mma_wait(1, deps=[acc])
        return acc
    else:
        a2_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc2.type.layout, k_width=2)
        acc2 = warpgroup_mma(gl.convert_layout(wd, a2_layout), x2_smem.index(slot).permute((1, 0)), acc2,
                             is_async=True)
        acc, acc2 = warpgroup_mma_wait(2, deps=[acc, acc2])
        return acc, acc2


@gluon.jit
def _gemm_tile(x_desc, BLOCK_M: gl.constexpr, w_desc, s_desc, wg_ptr, bias_ptr, out_ptr, row_out_ptr, row_w_ptr, N,
               K, e, pid_n, row_start, row_end, kc0, n_c, stride_om, stride_ge, stride_be,
               WARPS: gl.constexpr, REPEATS: gl.constexpr, STAGES: gl.constexpr, MXFP4: gl.constexpr,
               WG_MODE: gl.constexpr, HAS_BIAS: gl.constexpr, SWIGLU: gl.constexpr, ALPHA: gl.constexpr,
               LIMIT: gl.constexpr, SCATTER: gl.constexpr, HAS_RW: gl.constexpr, OUT_MMA_ORDER: gl.constexpr,
               FOLD: gl.constexpr, DECODE: gl.constexpr, SCALE: gl.constexpr, x2_desc=None, PDL: gl.constexpr = 0):
    """One program's tile of ``fp4_gemm_wgmma_kernel``: BLOCK_M activation rows from ``row_start``
    (valid below ``row_end``) x the weight rows of N tile ``pid_n`` of expert ``e``, the ``n_c`` K
    chunks from ``kc0``; mainloop and epilogue (module docstring). With ``x2_desc`` (a merged tail)
    the tile also runs the x2_desc box of rows after those BLOCK_M: a second accumulator fed by the
    same decoded weights, so the expert's short last tile costs no second decode."""
    NB: gl.constexpr = REPEATS * WARPS  # 16-row blocks per program
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    w_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 4], threads_per_warp=[1, 1, 32, 1],
                                              warps_per_cta=[WARPS, 1, 1, 1], order=[3, 2, 1, 0])
    NRB = (N + 15) // 16
    BLOCK_N: gl.constexpr = 16 * NB

    # the program's first weight row block (GEMM 1: first gate block, and its first up block)
    rb_e = e * NRB
    if SWIGLU > 0:
        rb0 = rb_e + pid_n * WARPS
        rb_up = rb0 + NRB // 2
    else:
        rb0 = rb_e + pid_n * NB
        rb_up = rb0

    x_smem, w_smem, s_smem, ready = _ring(x_desc, w_desc, s_desc, BLOCK_M, NB, STAGES)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    if x2_desc is None:
        # prologue: chunks 0 .. STAGES-3 in flight; with PDL = 2 their weights before the wait for the kernel
        # before (the launcher makes sure that kernel cannot be writing the weights), their activations after
        for i in gl.static_range(STAGES - 2):
            _load_chunk(i, n_c, kc0, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, row_start, rb0, rb_up, NB,
                        SWIGLU, PART=1 if PDL == 2 else 0)
        if PDL == 2:
            _pdl_enter()
            for i in gl.static_range(STAGES - 2):
                _load_chunk(i, n_c, kc0, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, row_start, rb0,
                            rb_up, NB, SWIGLU, PART=2)
        for j in range(0, n_c // 2):
            acc = _k_step(2 * j, n_c, kc0, acc, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, row_start,
                          rb0, rb_up, STAGES, WARPS, NB, SWIGLU, MXFP4, DECODE, SCALE, a_layout, w_layout)
            acc = _k_step(2 * j + 1, n_c, kc0, acc, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, row_start,
                          rb0, rb_up, STAGES, WARPS, NB, SWIGLU, MXFP4, DECODE, SCALE, a_layout, w_layout)
        if n_c % 2 == 1:
            acc = _k_step(n_c - 1, n_c, kc0, acc, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, row_start,
                          rb0, rb_up, STAGES, WARPS, NB, SWIGLU, MXFP4, DECODE, SCALE, a_layout, w_layout)
        acc = warpgroup_mma_wait(0, deps=[acc])
    else:
        EXT_M: gl.constexpr = x2_desc.block_type.shape[0]
        mma2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, EXT_M, 16])
        x2_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, EXT_M, 64], x2_desc.layout)
        acc2 = gl.zeros([BLOCK_N, EXT_M], gl.float32, layout=mma2)
        for i in gl.static_range(STAGES - 2):
            _load_chunk(i, n_c, kc0, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, row_start, rb0, rb_up, NB,
                        SWIGLU, x2_desc, x2_smem)
        for j in range(0, n_c // 2):
            acc, acc2 = _k_step(2 * j, n_c, kc0, acc, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready,
                                row_start, rb0, rb_up, STAGES, WARPS, NB, SWIGLU, MXFP4, DECODE, SCALE, a_layout,
                                w_layout, x2_desc, x2_smem, acc2)
            acc, acc2 = _k_step(2 * j + 1, n_c, kc0, acc, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready,
                                row_start, rb0, rb_up, STAGES, WARPS, NB, SWIGLU, MXFP4, DECODE, SCALE, a_layout,
                                w_layout, x2_desc, x2_smem, acc2)
        if n_c % 2 == 1:
            acc, acc2 = _k_step(n_c - 1, n_c, kc0, acc, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready,
                                row_start, rb0, rb_up, STAGES, WARPS, NB, SWIGLU, MXFP4, DECODE, SCALE, a_layout,
                                w_layout, x2_desc, x2_smem, acc2)
        acc, acc2 = warpgroup_mma_wait(0, deps=[acc, acc2])
        _tile_epilogue(acc2, FOLD, e, pid_n, row_start + BLOCK_M, row_end, N, wg_ptr, bias_ptr, row_w_ptr,
                       row_out_ptr, out_ptr, stride_ge, stride_be, stride_om, SWIGLU, WG_MODE, HAS_BIAS, HAS_RW,
                       SCATTER, OUT_MMA_ORDER)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    _tile_epilogue(acc, FOLD, e, pid_n, row_start, row_end, N, wg_ptr, bias_ptr, row_w_ptr, row_out_ptr, out_ptr,
                   stride_ge, stride_be, stride_om, SWIGLU, WG_MODE, HAS_BIAS, HAS_RW, SCATTER, OUT_MMA_ORDER)


@gluon.jit
def _ring(x_desc, w_desc, s_desc, BLOCK_M: gl.constexpr, NB: gl.constexpr, STAGES: gl.constexpr):
    """The ring, its mbarriers initialised: activation tiles (the 128-byte swizzle wgmma reads), the
    program's weight words ([NB, 128] int32 per chunk, each thread then reads its own 16 bytes) and
    their scale pairs, all by TMA on one mbarrier per stage."""
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 64], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, NB, 128], w_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.int16, [STAGES, NB, s_desc.block_type.shape[1]], s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()
    return x_smem, w_smem, s_smem, ready


@gluon.jit
def _tile_epilogue(acc, FOLD: gl.constexpr, e, pid_n, row_start, row_end, N, wg_ptr, bias_ptr, row_w_ptr, row_out_ptr,
                   out_ptr, stride_ge, stride_be, stride_om, SWIGLU: gl.constexpr, WG_MODE: gl.constexpr,
                   HAS_BIAS: gl.constexpr, HAS_RW: gl.constexpr, SCATTER: gl.constexpr, OUT_MMA_ORDER: gl.constexpr,
                   OPAQUE_ROWS: gl.constexpr = False):
    """A tile's epilogue in the accumulator's layout: the same helper as the Triton MoE kernels
    (globals, bias, activation, routing weight, store or scatter); the plain linear is GEMM 2 without
    routing weight or scatter, its one global read as "expert 0"."""
    BLOCK_N: gl.constexpr = acc.shape[0]
    BLOCK_M: gl.constexpr = acc.shape[1]
    if SWIGLU > 0:  # the two register repeats: gate rows, then the matching up rows
        acc_g, acc_u = gl.split(gl.permute(gl.reshape(acc, [2, BLOCK_N // 2, BLOCK_M]), [1, 2, 0]))
        N_OUT = N // 2
    else:
        acc_g = acc
        acc_u = acc
        N_OUT = N
    epi: gl.constexpr = acc_g.type.layout
    cols = pid_n * acc_g.shape[0] + gl.arange(0, acc_g.shape[0], layout=gl.SliceLayout(1, epi))
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, epi))
    if OPAQUE_ROWS:  # a persistent program: keep the compiler from hoisting the rows' offsets out of its tile loop
        rows = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [rows], dtype=gl.int32, is_pure=False, pack=1)
    rows = row_start + rows
    gate_rows, up_rows = _gate_up_rows(cols, N_OUT, SWIGLU, False)
    if OUT_MMA_ORDER:  # column j (bf16 pair j // 2) goes to its MMA position
        out_cols = 2 * mma_pair(cols // 2) + cols % 2
    else:
        out_cols = cols
    _moe_epilogue(acc_g, acc_u, FOLD, e, rows, rows < row_end, out_cols, cols < N_OUT, gate_rows, up_rows, wg_ptr,
                  bias_ptr, row_w_ptr, row_out_ptr, out_ptr, stride_ge, stride_be, stride_om,
                  SWIGLU, WG_MODE, HAS_BIAS, HAS_RW, SCATTER)


@gluon.jit
def program_tile(tile_expert_ptr, tile_start_ptr, tile_end_ptr, M, n_tiles_n, KC, n_tiles_m, BLOCK_M: gl.constexpr,
                 GROUPED: gl.constexpr, GROUP_M: gl.constexpr):
    """This program's (expert, N tile, first row, row end, K chunks): GROUPED, the dispatch plan's
    tile pid // n_tiles_n (tiles outer, N inner: concurrent programs share the tile's activations;
    an unused tile, expert -1, gets no rows and no K chunks); plain, raster groups of GROUP_M
    activation tiles x all N tiles (weights and activations stay in L2)."""
    pid = gl.program_id(0)
    if GROUPED:
        pid_n = pid % n_tiles_n
        pid_m = pid // n_tiles_n
        e = gl.load(tile_expert_ptr + pid_m)
        row_start = gl.load(tile_start_ptr + pid_m)
        row_end = gl.where(e >= 0, gl.load(tile_end_ptr + pid_m), row_start)
        kc_end = gl.where(e >= 0, KC, 0)
        e = gl.maximum(e, 0)
    else:
        pid_m, pid_n = _raster(pid, n_tiles_n, n_tiles_m, GROUP_M)
        e = 0
        row_start = pid_m * BLOCK_M
        row_end = M
        kc_end = KC
    return e, pid_n, row_start, row_end, kc_end


@gluon.jit
def _raster(tile, n_tiles_n, n_tiles_m, GROUP_M: gl.constexpr):
    """(M tile, N tile) of plain tile number ``tile``: raster groups of GROUP_M activation tiles x
    all N tiles, M fastest inside a group (weights and activations stay in L2)."""
    per_group = GROUP_M * n_tiles_n
    first_m = (tile // per_group) * GROUP_M
    size_m = gl.maximum(gl.minimum(n_tiles_m - first_m, GROUP_M), 1)  # >= 1 past the last tile too
    return first_m + (tile % per_group) % size_m, (tile % per_group) // size_m


@gluon.jit
def _gemm_persistent(x_desc, BLOCK_M: gl.constexpr, w_desc, s_desc, wg_ptr, bias_ptr, out_ptr, M, N, K, stride_om,
                     n_tiles_n, n_tiles_m, WARPS: gl.constexpr, REPEATS: gl.constexpr, STAGES: gl.constexpr,
                     MXFP4: gl.constexpr, WG_MODE: gl.constexpr, HAS_BIAS: gl.constexpr, FOLD: gl.constexpr,
                     DECODE: gl.constexpr, SCALE: gl.constexpr, GROUP_M: gl.constexpr):
    """The plain linear, persistent: program p computes tiles p, p + grid, ... (``_raster`` order)
    through one ring whose chunks run on from one tile into the next, so the next tile's first
    chunks load while this tile finishes and stores its output. Each tile's K loop is
    ``_gemm_tile``'s: unrolled by two, one wgmma group in flight (module docstring). The launcher
    guarantees K / 64 >= STAGES - 2, so a refill reaches at most into the next tile."""
    NB: gl.constexpr = REPEATS * WARPS
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    w_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 4], threads_per_warp=[1, 1, 32, 1],
                                              warps_per_cta=[WARPS, 1, 1, 1], order=[3, 2, 1, 0])
    KC = K // 64
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    my_tiles = (n_tiles_m * n_tiles_n - pid + nprog - 1) // nprog
    x_smem, w_smem, s_smem, ready = _ring(x_desc, w_desc, s_desc, BLOCK_M, NB, STAGES)
    m_next, n_next = _raster(pid, n_tiles_n, n_tiles_m, GROUP_M)
    for i in gl.static_range(STAGES - 2):  # prologue: the first tile's chunks 0 .. STAGES-3 in flight
        _load_stage(i, my_tiles > 0, i, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, m_next * BLOCK_M,
                    n_next * NB, n_next * NB, NB, 0)

    for t in range(my_tiles):
        # this tile and the next (whose first chunks the last refills of this one load), once per tile
        m_cur = m_next
        n_cur = n_next
        m_next, n_next = _raster(pid + (t + 1) * nprog, n_tiles_n, n_tiles_m, GROUP_M)
        tile = (m_cur * BLOCK_M, n_cur * NB, m_next * BLOCK_M, n_next * NB, t + 1 < my_tiles)
        g0 = t * KC
        acc = gl.zeros([16 * NB, BLOCK_M], gl.float32, layout=mma)
        for j in range(0, KC // 2):
            acc = _stream_step(g0, 2 * j, KC, tile, acc, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready,
                               STAGES, WARPS, NB, MXFP4, DECODE, SCALE, a_layout, w_layout)
            acc = _stream_step(g0, 2 * j + 1, KC, tile, acc, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready,
                               STAGES, WARPS, NB, MXFP4, DECODE, SCALE, a_layout, w_layout)
        if KC % 2 == 1:
            acc = _stream_step(g0, KC - 1, KC, tile, acc, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready,
                               STAGES, WARPS, NB, MXFP4, DECODE, SCALE, a_layout, w_layout)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _tile_epilogue(acc, FOLD, pid * 0, n_cur, m_cur * BLOCK_M, M, N, wg_ptr, bias_ptr, out_ptr, out_ptr, out_ptr,
                       0, 0, stride_om, 0, WG_MODE, HAS_BIAS, False, False, False, True)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


@gluon.jit
def _stream_step(g0, c, KC, tile, acc, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, STAGES: gl.constexpr,
                 WARPS: gl.constexpr, NB: gl.constexpr, MXFP4: gl.constexpr, DECODE: gl.constexpr,
                 SCALE: gl.constexpr, a_layout: gl.constexpr, w_layout: gl.constexpr):
    """``_k_step`` on a persistent program's stream (chunk c of the tile whose first chunk is stream
    chunk g0; ``tile`` = its first activation row and weight row block, the next tile's, and whether
    there is one): refill chunk c-2's buffers with chunk c + STAGES - 2, past KC the next tile's,
    then ``_mma_stage`` on chunk c."""
    r0, rb0, r0_next, rb0_next, has_next = tile
    gl.thread_barrier()
    cn = c + STAGES - 2
    nxt = cn >= KC
    _load_stage((g0 + cn) % STAGES, (cn < KC) | has_next, gl.where(nxt, cn - KC, cn), x_desc, w_desc, s_desc,
                x_smem, w_smem, s_smem, ready, gl.where(nxt, r0_next, r0), gl.where(nxt, rb0_next, rb0),
                gl.where(nxt, rb0_next, rb0), NB, 0)
    g = g0 + c
    return _mma_stage(g % STAGES, (g // STAGES) & 1, acc, x_smem, w_smem, s_smem, ready, WARPS, NB, MXFP4, DECODE,
                      SCALE, a_layout, w_layout)


@gluon.jit
def fp4_gemm_wgmma_kernel(
    w_desc,  # TMA descriptor of the int32 weight words as [E * N/16, K/64 * 128] (mma_layout's [.., K/64, 32, 4]),
    #          block [REPEATS WARPS, 128] (GEMM 1: half that, gate and up blocks copied apart); E = 1 unless GROUPED
    s_desc,  # TMA descriptor of the int16 scale pairs as [E * N/16, K/64 * S] (S = 32 NVFP4, 16 MXFP4), rows as w_desc
    x_desc,  # TMA descriptor of the bf16 activations in MMA K order [rows, K], block [BLOCK_M, 64] (``mma_order_rows``)
    x_tail_desc,  # TAIL_M > 0: the same activations, block [TAIL_M, 64]; else unused (pass x_desc)
    wg_ptr,  # plain: [1] fp32 global (WG_MODE 1); GROUPED: [E] (1) or [E, N] (2, stride_ge); else unused
    bias_ptr,  # plain: [N]; GROUPED: [E, N] (stride_be); HAS_BIAS, else unused
    out_ptr,  # plain: y [M, N]; GEMM 1: h [R, N/2]; GEMM 2: pair rows [T*k, N] (stride_om)
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,  # GROUPED: the dispatch plan's tiles
    row_out_ptr,  # SCATTER: [R] int32 output row of each sorted row
    row_w_ptr,  # HAS_RW: [R] fp32 routing weight of each sorted row (mode 1 of ``kernels.moe._moe_epilogue``)
    M, N, K,  # M: rows (plain) or sorted rows R (GROUPED); N weight rows (per expert); K stored (64s)
    stride_om, stride_ge, stride_be, n_tiles_m,  # n_tiles_m: plain: cdiv(M, BLOCK_M); GROUPED: tiles
    k_per_split,  # plain: K chunks per program along grid axis 1 (split-K: program s sums chunks from s k_per_split
    #               and writes its fp32 partial at out_ptr + s M stride_om, for ``splitk_reduce_kernel``)
    BLOCK_M: gl.constexpr,  # activation rows per program (the wgmma N side): 16 to 256 (256: REPEATS = 1)
    WARPS: gl.constexpr,  # 4 (one warpgroup) or 8 (two)
    REPEATS: gl.constexpr,  # 16-row weight blocks per warp: 2 (32 WARPS weight rows; GEMM 1 needs it) or 1
    STAGES: gl.constexpr,  # ring depth (chunks c+1 .. c + STAGES - 2 load while c computes)
    MXFP4: gl.constexpr, WG_MODE: gl.constexpr, HAS_BIAS: gl.constexpr,
    SWIGLU: gl.constexpr,  # 0 none, 1 silu(g) * u, 2 gpt-oss clamped variant (ALPHA, LIMIT)
    ALPHA: gl.constexpr, LIMIT: gl.constexpr,
    GROUPED: gl.constexpr, SCATTER: gl.constexpr, HAS_RW: gl.constexpr,
    OUT_MMA_ORDER: gl.constexpr,  # GEMM 1: h written in MMA K order (GEMM 2's activations, read by TMA as they are)
    FOLD: gl.constexpr, DECODE: gl.constexpr, SCALE: gl.constexpr,
    GROUP_M: gl.constexpr,  # plain: M tiles per raster group (weights and activations stay in L2)
    TAIL_M: gl.constexpr,  # GROUPED: tiles of at most TAIL_M rows run as TAIL_M-row tiles (0: never)
    PERSISTENT: gl.constexpr = False,  # plain, no split-K: ``_gemm_persistent`` (grid <= tiles)
    MERGE_TAIL: gl.constexpr = False,  # GROUPED, TAIL_M > 0: an expert's full tile followed by its short last
    #                                    tile (<= TAIL_M rows) runs both (x_tail_desc's box after its own), the
    #                                    short tile's programs do nothing
    PDL: gl.constexpr = 0,  # plain, not persistent: programmatic dependent launch (``kernels.pdl``): 1 wait for
    #                         the kernel before first; 2 request the first chunks' weights, then wait (the kernel
    #                         before must not write the weights)
):
    NB: gl.constexpr = REPEATS * WARPS  # 16-row blocks per program
    gl.static_assert((SWIGLU == 0) or (REPEATS == 2), "the fused activation pairs register repeats")
    gl.static_assert(PDL == 0 or not (GROUPED or PERSISTENT), "PDL: the plain linear's tiles")
    BLOCK_N: gl.constexpr = 16 * NB
    if PDL == 1:
        _pdl_enter()

    KC = K // 64
    if SWIGLU > 0:
        n_tiles_n = (N // 2 + BLOCK_N // 2 - 1) // (BLOCK_N // 2)
    else:
        n_tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    if PERSISTENT:
        gl.static_assert(not GROUPED and SWIGLU == 0 and TAIL_M == 0, "persistent: the plain linear only")
        _gemm_persistent(x_desc, BLOCK_M, w_desc, s_desc, wg_ptr, bias_ptr, out_ptr, M, N, K, stride_om, n_tiles_n,
                         n_tiles_m, WARPS, REPEATS, STAGES, MXFP4, WG_MODE, HAS_BIAS, FOLD, DECODE, SCALE, GROUP_M)
        return
    e, pid_n, row_start, row_end, kc_end = program_tile(tile_expert_ptr, tile_start_ptr, tile_end_ptr, M, n_tiles_n,
                                                        KC, n_tiles_m, BLOCK_M, GROUPED, GROUP_M)
    kc0 = 0
    if not GROUPED:  # split-K (one split: k_per_split = KC)
        pid_k = gl.program_id(1)
        kc0 = pid_k * k_per_split
        kc_end = gl.minimum(kc0 + k_per_split, KC)
        out_ptr += pid_k.to(gl.int64) * M * stride_om
    n_c = kc_end - kc0

    # the tile: TAIL_M-row wgmmas for an expert's short last tile (or an unused one), else BLOCK_M-row
    # ones; the variants' shared buffers live in exclusive branches and share the same bytes
    if MERGE_TAIL:
        gl.static_assert(GROUPED and TAIL_M > 0, "merged tails: the MoE GEMMs with tail tiles")
        # the plan's tiles of one expert are consecutive, each full but the last: the tile before a
        # short one (<= TAIL_M rows) of the same expert runs it (its rows end where the short one's start)
        pid_m = gl.program_id(0) // n_tiles_n
        short = row_end - row_start <= TAIL_M
        prev_e = gl.load(tile_expert_ptr + gl.maximum(pid_m - 1, 0))
        has_next = pid_m + 1 < n_tiles_m
        i_next = gl.minimum(pid_m + 1, n_tiles_m - 1)
        next_e = gl.load(tile_expert_ptr + i_next)
        next_end = gl.load(tile_end_ptr + i_next)
        next_rows = next_end - gl.load(tile_start_ptr + i_next)
        merged = has_next & (next_e == e) & (next_rows <= TAIL_M) & (not short)
        if short:
            if (pid_m == 0) | (prev_e != e):  # an expert's only tile (a merged tail's programs skip it)
                _gemm_tile(x_tail_desc, TAIL_M, w_desc, s_desc, wg_ptr, bias_ptr, out_ptr, row_out_ptr, row_w_ptr, N,
                           K, e, pid_n, row_start, row_end, kc0, n_c, stride_om, stride_ge, stride_be, WARPS, REPEATS,
                           STAGES, MXFP4, WG_MODE, HAS_BIAS, SWIGLU, ALPHA, LIMIT, SCATTER, HAS_RW, OUT_MMA_ORDER,
                           FOLD, DECODE, SCALE)
        elif merged:
            _gemm_tile(x_desc, BLOCK_M, w_desc, s_desc, wg_ptr, bias_ptr, out_ptr, row_out_ptr, row_w_ptr, N, K, e,
                       pid_n, row_start, next_end, kc0, n_c, stride_om, stride_ge, stride_be, WARPS, REPEATS, STAGES,
                       MXFP4, WG_MODE, HAS_BIAS, SWIGLU, ALPHA, LIMIT, SCATTER, HAS_RW, OUT_MMA_ORDER, FOLD, DECODE,
                       SCALE, x_tail_desc)
        else:
            _gemm_tile(x_desc, BLOCK_M, w_desc, s_desc, wg_ptr, bias_ptr, out_ptr, row_out_ptr, row_w_ptr, N, K, e,
                       pid_n, row_start, row_end, kc0, n_c, stride_om, stride_ge, stride_be, WARPS, REPEATS, STAGES,
                       MXFP4, WG_MODE, HAS_BIAS, SWIGLU, ALPHA, LIMIT, SCATTER, HAS_RW, OUT_MMA_ORDER, FOLD, DECODE,
                       SCALE)
    elif TAIL_M > 0:
        if row_end - row_start <= TAIL_M:
            _gemm_tile(x_tail_desc, TAIL_M, w_desc, s_desc, wg_ptr, bias_ptr, out_ptr, row_out_ptr, row_w_ptr, N, K, e,
                       pid_n, row_start, row_end, kc0, n_c, stride_om, stride_ge, stride_be, WARPS, REPEATS, STAGES,
                       MXFP4, WG_MODE, HAS_BIAS, SWIGLU, ALPHA, LIMIT, SCATTER, HAS_RW, OUT_MMA_ORDER, FOLD, DECODE,
                       SCALE)
        else:
            _gemm_tile(x_desc, BLOCK_M, w_desc, s_desc, wg_ptr, bias_ptr, out_ptr, row_out_ptr, row_w_ptr, N, K, e,
                       pid_n, row_start, row_end, kc0, n_c, stride_om, stride_ge, stride_be, WARPS, REPEATS, STAGES,
                       MXFP4, WG_MODE, HAS_BIAS, SWIGLU, ALPHA, LIMIT, SCATTER, HAS_RW, OUT_MMA_ORDER, FOLD, DECODE,
                       SCALE)
    else:
        _gemm_tile(x_desc, BLOCK_M, w_desc, s_desc, wg_ptr, bias_ptr, out_ptr, row_out_ptr, row_w_ptr, N, K, e, pid_n,
                   row_start, row_end, kc0, n_c, stride_om, stride_ge, stride_be, WARPS, REPEATS, STAGES, MXFP4,
                   WG_MODE, HAS_BIAS, SWIGLU, ALPHA, LIMIT, SCATTER, HAS_RW, OUT_MMA_ORDER, FOLD, DECODE, SCALE,
                   PDL=PDL)


@triton.jit
def mma_order_rows_kernel(
    x_ptr,  # int32 view of bf16 activations [rows, K_X / 2] (stride_x int32 per row)
    row_ptr,  # GATHER: [R] int32 source row of each output row
    out_ptr,  # int32 view of the bf16 output [R, K / 2] (stride_o), K a multiple of 64
    R, K_X, stride_x, stride_o,
    GATHER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr,  # BLOCK_Q pairs, a multiple of 32
    PDL: tl.constexpr = 0,  # ``kernels.pdl``
):
    """Activations into the weights' MMA K order for the wgmma kernel's TMA loads: output pair q of a
    64-K chunk (MMA pair 8kl + 4i2 + t) is stored pair 8t + 2kl + i2 of that chunk (``mma_layout``);
    rows optionally gathered (MoE GEMM 1: one row per token-expert pair; a negative source row, a
    dropped pair, reads as zeros); K past K_X is zero.

    With u = 2kl + i2 the chunk's stored pair 8t + u goes to 4u + t: a [4, 8] -> [8, 4] transpose of
    its 32 pairs. The tile is loaded and stored contiguously (16-byte vectors) and transposed in
    registers (the compiler's layout conversion through shared memory), not pair by pair from the
    permuted addresses (docs/performance-engineering.md, ``mma_order_rows_kernel``)."""
    pdl_enter(PDL)
    pid_r = tl.program_id(0)
    pid_q = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < R
    src = tl.load(row_ptr + r, mask=r_mask, other=0) if GATHER else r
    q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    v = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + q[None, :],
                mask=(r_mask & (src >= 0))[:, None] & (2 * q < K_X)[None, :], other=0)
    v = tl.reshape(tl.permute(tl.reshape(v, (BLOCK_R, BLOCK_Q // 32, 4, 8)), (0, 1, 3, 2)), (BLOCK_R, BLOCK_Q))
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_o + q[None, :], v, mask=r_mask[:, None])
