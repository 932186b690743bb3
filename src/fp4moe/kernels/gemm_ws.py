"""Prefill FP4 GEMM for Hopper (SM90), warp-specialized: a decode warpgroup feeds shared-memory
wgmma (Gluon). Opt-in (``WgmmaConfig(ws=True)``): slower than the register-A kernel
(``gemm_wgmma``; docs/performance-engineering.md, ``WgmmaConfig.ws``), so no heuristic chooses it.

``gemm_wgmma`` decodes the FP4 weights on the warps that issue the wgmmas, into the register A
operand, so the decode and the barrier waits sit on the tensor cores' critical path. Here each
program splits into two partitions (``gl.warp_specialize``):

  MMA (the default partition, WARPS = 8 warps, two warpgroups of 64 weight rows): issues the TMA
      copies of chunk c (activation tile, weight words, scale pairs) into ring slot c % STAGES on
      ``ready``; waits for chunk c's activations and its decoded A tile (``a_ready``), issues the
      wgmma with both operands in shared memory, keeps one group in flight, and once the wait
      retires chunk c - 1 releases its A slot (``a_empty``) and refills its TMA slot with chunk
      c - 1 + STAGES. Then the epilogue, in the accumulator's layout.
  decode (one warpgroup, registers set by ``setmaxnreg``): waits ``ready``, reads the slot's
      weight words and scales, decodes them (``mma_decode.decode_a_operand``, the registers of the
      register-A kernel), waits ``a_empty``, stores the bf16 A tile [128, 64] in the 128-byte
      swizzle (stmatrix), fences, arrives ``a_ready`` (which also tells the MMA partition that the
      words were read).

A third, 1-warp TMA partition does not fit: registers are allocated per warpgroup, 16 warps
leave 128 registers per thread, and the MMA warps' 128 accumulators need ptxas's 154. Both
operands from shared memory also removes the Triton 3.6 register-A hazard
(triton-lang/triton#9433) that ``gemm_wgmma`` works around by unrolling.

What bounds it: the decode partition's per-chunk chain of mbarrier waits, partition barriers, the
proxy fence (ptxas: MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC) and arrives, whatever the tile height, decode
warps, A ring depth, wgmma groups in flight or TMA lead; so nothing else sits on that chain (the
scales come by TMA, the fence would wait for global loads in flight; the MMA warps issue the TMA).
A 256-row tile's MMA per chunk is shorter than the chain (docs/performance-engineering.md,
``WgmmaConfig.ws``).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .gemm_wgmma import load_scales, program_tile
from .mma_decode import decode_a_operand
from .moe import _moe_epilogue


@gluon.jit
def _ws_load(cn, kc_end, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, row_start, rb0):
    """TMA copies of chunk ``cn`` (none at or past kc_end) into ring slot cn % STAGES, whose
    previous chunk the caller (the MMA partition) has retired: its wgmma is done and the decoder's
    ``a_ready`` for it, which the MMA waited for, came after the decoder read the words and fenced.
    The activation tile, the weight words and their scales (rows past the program's weights are
    the next expert's or zeros: never stored)."""
    STAGES: gl.constexpr = x_smem.shape[0]
    slot = cn % STAGES
    pred = cn < kc_end
    mbarrier.expect(ready.index(slot), x_desc.block_type.nbytes + w_desc.block_type.nbytes
                    + s_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(x_desc, [row_start, cn * 64], ready.index(slot), x_smem.index(slot), pred=pred)
    tma.async_copy_global_to_shared(w_desc, [rb0, cn * 128], ready.index(slot), w_smem.index(slot), pred=pred)
    tma.async_copy_global_to_shared(s_desc, [rb0, cn * s_desc.block_type.shape[1]], ready.index(slot),
                                    s_smem.index(slot), pred=pred)


@gluon.jit
def _ws_decoder(w_smem, s_smem, a_smem, ready, a_ready, a_empty, kc_end, MXFP4: gl.constexpr,
                DECODE: gl.constexpr, SCALE: gl.constexpr):
    """Decode partition (one warpgroup): chunk c's weight words and scales -> the bf16 A tile [16 NB, 64]
    in MMA K order, in ring slot c % A_STAGES of ``a_smem`` (its ``a_ready`` also tells the MMA
    partition that the words were read, so that it may refill their slot). Its
    loop is one chain of waits, barriers and the proxy fence per chunk, so it issues nothing else:
    no TMA copies (the MMA partition does) and no global loads (ptxas makes the proxy fence wait
    for the thread's pending loads: with the scales through registers, a whole load latency per
    chunk)."""
    STAGES: gl.constexpr = w_smem.shape[0]
    A_STAGES: gl.constexpr = a_smem.shape[0]
    NB: gl.constexpr = w_smem.shape[1]  # 16-row blocks: two per warp
    DW: gl.constexpr = 4
    parent: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[DW, 1], instr_shape=[16, 64, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=parent, k_width=2)
    w_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 4], threads_per_warp=[1, 1, 32, 1],
                                              warps_per_cta=[DW, 1, 1, 1], order=[3, 2, 1, 0])
    s_layout: gl.constexpr = gl.SliceLayout(3, w_layout)
    for c in range(kc_end):
        slot = c % STAGES
        mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
        w = w_smem.index(slot).reshape([NB, 1, 32, 4]).load(w_layout)
        s = load_scales(s_smem.index(slot), MXFP4, s_layout, DW)
        wd = decode_a_operand(w, s, NB, 1, DECODE, SCALE, a_layout)
        a_slot = c % A_STAGES
        mbarrier.wait(a_empty.index(a_slot), ((c // A_STAGES) & 1) ^ 1)
        a_smem.index(a_slot).store(wd)
        # the A tile is read by wgmma and the word slot rewritten by TMA: both the async proxy
        fence_async_shared()
        mbarrier.arrive(a_ready.index(a_slot), count=1)


@gluon.jit
def _ws_mma(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, a_smem, ready, a_ready, a_empty, row_start, rb0,
            kc_end, BLOCK_M: gl.constexpr, WARPS: gl.constexpr):
    """MMA partition (the default, WARPS warps): chunk c's wgmma from the A and activation slots,
    one group in flight; once chunk c's wait retires chunk c - 1, its A slot is released and its
    TMA slot refilled with chunk c - 1 + STAGES."""
    STAGES: gl.constexpr = x_smem.shape[0]
    A_STAGES: gl.constexpr = a_smem.shape[0]
    BLOCK_N: gl.constexpr = a_smem.shape[1]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    for i in gl.static_range(STAGES):
        _ws_load(i, kc_end, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, row_start, rb0)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    for c in range(kc_end):
        slot = c % STAGES
        a_slot = c % A_STAGES
        mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
        mbarrier.wait(a_ready.index(a_slot), (c // A_STAGES) & 1)
        acc = warpgroup_mma(a_smem.index(a_slot), x_smem.index(slot).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])
        mbarrier.arrive(a_empty.index((c + A_STAGES - 1) % A_STAGES), count=1, pred=c > 0)
        _ws_load(gl.where(c > 0, c - 1 + STAGES, kc_end), kc_end, x_desc, w_desc, s_desc, x_smem, w_smem, s_smem,
                 ready, row_start, rb0)
    acc = warpgroup_mma_wait(0, deps=[acc])
    return (acc,)  # the default partition's results are a tuple


@gluon.jit
def fp4_gemm_ws_kernel(
    w_desc,  # TMA descriptor of the int32 weight words [E * N/16, K/64 * 128], block [BLOCK_N / 16, 128]
    s_desc,  # TMA descriptor of the int16 scale pairs as [E * N/16, K/64 * S] (S = 32 NVFP4, 16 MXFP4), block [BLOCK_N / 16, S]
    x_desc,  # TMA descriptor of the bf16 activations in MMA K order [rows, K], block [BLOCK_M, 64]
    wg_ptr, bias_ptr, out_ptr,  # as ``fp4_gemm_wgmma_kernel``
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, row_out_ptr, row_w_ptr,
    M, N, K, stride_om, stride_ge, stride_be, n_tiles_m,
    BLOCK_M: gl.constexpr,  # activation rows per program: 64, 128 or 256
    WARPS: gl.constexpr,  # MMA warps: 8 (two warpgroups of 64 weight rows: BLOCK_N = 128)
    STAGES: gl.constexpr,  # TMA ring depth (activation tile, weight words, scale pairs)
    A_STAGES: gl.constexpr,  # decoded A tile ring depth
    MXFP4: gl.constexpr, WG_MODE: gl.constexpr, HAS_BIAS: gl.constexpr,
    GROUPED: gl.constexpr, SCATTER: gl.constexpr, HAS_RW: gl.constexpr,
    FOLD: gl.constexpr, DECODE: gl.constexpr, SCALE: gl.constexpr, GROUP_M: gl.constexpr,
    DECODE_REGS: gl.constexpr,  # registers per thread of the decode warpgroup (setmaxnreg)
):
    """``out = x @ W^T``, BLOCK_N = 128 weight rows x BLOCK_M activation rows per program (module
    docstring). The arguments are ``fp4_gemm_wgmma_kernel``'s, but only the plain linear is built:
    no MoE launcher uses this kernel (GROUPED is refused)."""
    gl.static_assert(not GROUPED, "the warp-specialized kernel runs the plain linear only")
    BLOCK_N: gl.constexpr = 128
    NB: gl.constexpr = BLOCK_N // 16
    gl.static_assert(A_STAGES >= 2, "the decoder waits for chunk c - A_STAGES, which the MMA releases at chunk "
                     "c - A_STAGES + 1: one decoded tile would deadlock")
    gl.static_assert(STAGES >= 2, "the TMA ring holds the chunk in flight and the next")
    KC = K // 64
    e, pid_n, row_start, row_end, kc_end = program_tile(tile_expert_ptr, tile_start_ptr, tile_end_ptr, M,
                                                        (N + BLOCK_N - 1) // BLOCK_N, KC, n_tiles_m, BLOCK_M,
                                                        GROUPED, GROUP_M)
    NRB = (N + 15) // 16  # 16-row blocks per expert

    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 64], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, NB, 128], w_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.int16, [STAGES] + s_desc.block_type.shape, s_desc.layout)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [A_STAGES, BLOCK_N, 64], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(A_STAGES):
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(a_empty.index(i), count=1)
    fence_async_shared()

    acc = gl.warp_specialize([
        (_ws_mma, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, a_smem, ready, a_ready, a_empty, row_start,
                   e * NRB + pid_n * NB, kc_end, BLOCK_M, WARPS)),
        (_ws_decoder, (w_smem, s_smem, a_smem, ready, a_ready, a_empty, kc_end, MXFP4, DECODE, SCALE)),
    ], [4], [DECODE_REGS])[0]

    epi: gl.constexpr = acc.type.layout
    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, epi))
    rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, epi))
    _moe_epilogue(acc, acc, FOLD, e, rows, rows < row_end, cols, cols < N, cols, cols, wg_ptr,
                  bias_ptr, row_w_ptr, row_out_ptr, out_ptr, stride_ge, stride_be, stride_om,
                  0, WG_MODE, HAS_BIAS, HAS_RW, SCATTER)
