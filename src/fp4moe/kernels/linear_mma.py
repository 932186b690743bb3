"""W4A16 FP4 linear kernel on weights stored in MMA-operand order (Gluon, compiled CUDA only).

Why a second kernel: the Triton kernel in ``linear.py`` loads packed weights in a coalesced
layout, and the compiler then moves every byte into the tensor-core operand layout through
shared memory (byte-wise ``ld.shared`` + ``prmt``): ~5 of its ~8 instructions per weight
element (docs/performance-engineering.md). Here the weights are re-ordered once, at load time
(``fp4moe.ops.mma_layout``), so that one 16-byte load gives each thread exactly the nibbles of
its ``mma.sync.m16n8k16`` A fragments, and the decoded registers *are* the operand: the layout
conversion is asserted trivial at compile time (``assert_trivial=True``).

Stored layout (``fp4moe.ops.mma_layout`` writes it, its docstring has the bit-level detail):
  words  int32 [N/16, K/64, 32, 4]: for 16 weight rows x 64 K, lane ``l = 4g + t`` owns 4
         consecutive words, word ``kl`` holding its 8 A-fragment values of K tile ``kl``.
  scales uint8 [N/16, K/64, 8, 8] (NVFP4: one pair (row g, row g+8) per K tile, re-encoded so
         that one integer multiply-add gives the bf16 scale) or [N/16, K/64, 8, 4] (MXFP4: one
         pair per 32 K).
Computes the transposed product (weights are the MMA's M side, tokens its N side) like the
Triton kernel, with the same split-K partial-sum convention (``splitk_reduce_kernel``).
"""

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .mma_decode import _pdl_enter, _pdl_release, _pdl_wait, decode_a_operand, decode_a_operand_kw

# The decodes' common end: registers u0..u3 (each two values, as bf16 bits of value * 2**-126)
# times the scale pairs ($9: row g, $10: row g + 8; an fma with -0 keeps the sign of zero), split
# into the 8 bf16 outputs.
_SCALE_PAIRS_OUT = """fma.rn.bf16x2 r0, u0, $9, nz;
fma.rn.bf16x2 r1, u1, $10, nz;
fma.rn.bf16x2 r2, u2, $9, nz;
fma.rn.bf16x2 r3, u3, $10, nz;
mov.b32 {$0, $1}, r0;
mov.b32 {$2, $3}, r1;
mov.b32 {$4, $5}, r2;
mov.b32 {$6, $7}, r3;
}
"""
# Decode one word (8 E2M1 codes, nibble p = 4*i0 + 2*i2 + i1 of fragment value (i2, i1, i0)) with
# its two block scales (bf16x2, from ``_SCALE_ASM``) into the 8 bf16 A-fragment values. Nibble
# pairs (p, p+4) share one 32-bit register, 16 bits apart: mask them, one multiply places each
# magnitude at bf16 bits 8..6 and its sign at bit 15 of its half (the E2M1 value times 2**-126,
# a bf16 subnormal for code 1 as in E2M1 itself), a mask drops the copies, and one multiply by
# the scale (times 2**F) leaves value * scale * 2**(F - 126), exact; the kernel multiplies the
# accumulator by FOLD = 2**(126 - F) once.
_DECODE_ASM = """
{
.reg .b32 w8, u0, u1, u2, u3, r0, r1, r2, r3, nz;
mov.b32 nz, 0x80008000;
shr.u32 w8, $8, 8;
and.b32 u0, $8, 0x000F000F;
and.b32 u1, $8, 0x00F000F0;
and.b32 u2, w8, 0x000F000F;
and.b32 u3, w8, 0x00F000F0;
mul.lo.u32 u0, u0, 0x1040;
mul.lo.u32 u1, u1, 0x104;
mul.lo.u32 u2, u2, 0x1040;
mul.lo.u32 u3, u3, 0x104;
and.b32 u0, u0, 0x81C081C0;
and.b32 u1, u1, 0x81C081C0;
and.b32 u2, u2, 0x81C081C0;
and.b32 u3, u3, 0x81C081C0;
""" + _SCALE_PAIRS_OUT
# A lane's scale pair (low byte: row g, high byte: row g + 8) -> two bf16x2 registers, each
# scale * 2**F in both halves: prmt spreads a byte into both halves, one multiply-add turns the
# stored code into the bf16 bit pattern. One pair serves all 4 words of a lane's 64-K chunk.
_SCALE_ASM = """
{
.reg .b32 s;
cvt.u32.u16 s, $2;
prmt.b32 $0, s, 0, 0x4040;
prmt.b32 $1, s, 0, 0x4141;
mad.lo.u32 $0, $0, SCALE_MUL, SCALE_ADD;
mad.lo.u32 $1, $1, SCALE_MUL, SCALE_ADD;
}
"""
#: (multiplier, addend) turning a stored scale byte into bf16 scale * 2**F, per format
NVFP4_SCALE_MAD = (16, 0x75807580)  # E5M3 code (bias -10) << 4, exponent + 235: scale * 2**118
MXFP4_SCALE_MAD = (128, 0x32003200)  # E8M0 e << 7, exponent + 100: scale * 2**100
FOLD_E4M3 = 256.0  # 2**(126 - 118)
FOLD_E8M0 = 67108864.0  # 2**(126 - 100)
# The same 8 values from a word in the rotation order (``ops.mma_layout.WORD_ORDERS["rotation"]``):
# register j takes its 8 bits from the word shifted or rotated left by 6, 12, 2 (one mask each);
# register 3's exponent and sign bits already sit in place and its two mantissa bits come from the
# word rotated by 8 (one lop3: (rot & m) | (w & m')). 9 integer operations per word against 13.
_DECODE_ASM_ROTATION = """
{
.reg .b32 m3, u0, u1, u2, u3, r0, r1, r2, r3, nz;
mov.b32 nz, 0x80008000;
shl.b32 u0, $8, 6;
shf.l.wrap.b32 u1, $8, $8, 12;
shl.b32 u2, $8, 2;
shf.l.wrap.b32 m3, $8, $8, 8;
and.b32 u0, u0, 0x81C081C0;
and.b32 u1, u1, 0x81C081C0;
and.b32 u2, u2, 0x81C081C0;
and.b32 u3, $8, 0x81808180;
lop3.b32 u3, m3, 0x00400040, u3, 0xEA;
""" + _SCALE_PAIRS_OUT
DECODE_ASM = _DECODE_ASM
#: the decode of each stored bit order of the packed words (``ops.mma_layout.WORD_ORDERS``)
DECODE_ASMS = {"nibble": _DECODE_ASM, "rotation": _DECODE_ASM_ROTATION}


@functools.cache  # launch arguments: built once per shape, not per call
def decode_asm(order: str) -> str:
    """The ``DECODE`` constexpr of the decode kernels for words stored in bit order ``order``."""
    if order not in DECODE_ASMS:
        raise ValueError(f"order: expected one of {sorted(DECODE_ASMS)}, got {order!r}")
    return DECODE_ASMS[order]


@functools.cache  # launch arguments: built once per shape, not per call
def scale_asm(mxfp4: bool) -> str:
    mul, add = MXFP4_SCALE_MAD if mxfp4 else NVFP4_SCALE_MAD
    return _SCALE_ASM.replace("SCALE_MUL", str(mul)).replace("SCALE_ADD", hex(add))


@gluon.jit
def _arange4(n0: gl.constexpr, n1: gl.constexpr, n2: gl.constexpr, n3: gl.constexpr, layout: gl.constexpr):
    """Index tensors of a 4-D ``layout``, each broadcastable to [n0, n1, n2, n3]."""
    i0 = gl.arange(0, n0, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout))))
    i1 = gl.arange(0, n1, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, layout))))
    i2 = gl.arange(0, n2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, layout))))
    i3 = gl.arange(0, n3, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, layout))))
    i0 = gl.expand_dims(gl.expand_dims(gl.expand_dims(i0, 1), 2), 3)
    i1 = gl.expand_dims(gl.expand_dims(gl.expand_dims(i1, 0), 2), 3)
    i2 = gl.expand_dims(gl.expand_dims(gl.expand_dims(i2, 0), 1), 3)
    i3 = gl.expand_dims(gl.expand_dims(gl.expand_dims(i3, 0), 1), 2)
    return i0, i1, i2, i3


@gluon.jit
def _l2_prefetch(ptrs, nbytes, pred):
    """Where ``pred``, request ``nbytes`` (a multiple of 16; 16-byte aligned pointers) from each
    pointer into L2: one bulk prefetch (SM90+), nothing returned or waited for."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r,r", [ptrs, gl.full(ptrs.shape, nbytes, gl.int32, layout=ptrs.type.layout), pred.to(gl.int32)],
        dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _l2_prefetch_runs(wq_ptr, sc_ptr, rb0, rb_max, KC, slice_chunks, c, n_chunks, ok,
                      WARPS: gl.constexpr, RB: gl.constexpr, S_STEP: gl.constexpr):
    """``MMAConfig.pf``: lane 0 of each warp requests ``n_chunks`` 64-K chunks from chunk ``c`` of
    each of its row blocks' words and scales into L2, where ``ok``: two bulk prefetches per row block
    (each block's run of chunks is contiguous). Warp w owns row blocks rb0 + w % WARPS + r WARPS
    (r < RB; past rb_max, rb_max) of K slice w // WARPS (``slice_chunks`` chunks each), as
    ``fp4_linear_mma_kw_kernel``'s w_layout places them. The warp's row block and the addresses are
    computed in the asm from scalars each time: pointer tensors held across the loop cost 16-26
    registers per thread (sm_90, ptxas), this none."""
    for r in gl.static_range(RB):
        gl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t, w, g, q, b; .reg .u64 a; "
            "mov.u32 t, %tid.x; and.b32 q, t, 31; setp.eq.u32 p, q, 0; setp.ne.and.u32 p, $1, 0, p; "
            "shr.u32 w, t, 5; and.b32 g, w, $2; shr.u32 q, w, $3; add.u32 b, $4, g; min.u32 b, b, $5; "
            "mad.lo.u32 b, b, $6, $8; mad.lo.u32 b, q, $7, b; "
            "mul.wide.u32 a, b, 512; add.u64 a, a, $9; @p cp.async.bulk.prefetch.L2.global [a], $10; "
            "mul.wide.u32 a, b, $12; add.u64 a, a, $11; @p cp.async.bulk.prefetch.L2.global [a], $13; "
            "mov.b32 $0, 0; }",
            "=r,r,r,r,r,r,r,r,r,l,r,l,r,r",
            # (c * 0 + a constant: a scalar tensor operand for the asm)
            [ok.to(gl.int32), c * 0 + (WARPS - 1), c * 0 + (WARPS.bit_length() - 1), rb0 + r * WARPS, rb_max, KC,
             slice_chunks, c, wq_ptr, n_chunks * 512, sc_ptr, c * 0 + 2 * S_STEP, n_chunks * (2 * S_STEP)],
            dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _x_ring_fill(x_ring, xc_ptrs, xc_mask, c_first, c_last, KH: gl.constexpr, X_STAGES: gl.constexpr):
    """x's ring before the loop: steps 0 .. X_STAGES - 2 from 64-K chunk ``c_first`` (past ``c_last``
    re-reading it), one copy group each; rows where ``xc_mask`` is false are zero-filled."""
    for i in gl.static_range(X_STAGES - 1):
        async_copy.async_copy_global_to_shared(x_ring.index(i), xc_ptrs + gl.minimum(c_first + i * KH, c_last) * 64,
                                               mask=xc_mask)
        async_copy.commit_group()


@gluon.jit
def _x_ring_wait(x_ring, xc_ptrs, xc_mask, it, c0, c_last, KH: gl.constexpr, X_STAGES: gl.constexpr):
    """``_x_ring_step`` up to the wait: step it's ring slot, not yet loaded (``XC`` reads it per chunk)."""
    c_pf = gl.minimum(c0 + (X_STAGES - 1) * KH, c_last)
    async_copy.async_copy_global_to_shared(x_ring.index((it + X_STAGES - 1) % X_STAGES), xc_ptrs + c_pf * 64,
                                           mask=xc_mask)
    async_copy.commit_group()
    async_copy.wait_group(X_STAGES - 1)
    return x_ring.index(it % X_STAGES)


@gluon.jit
def _x_ring_step(x_ring, xc_ptrs, xc_mask, it, c0, c_last, KH: gl.constexpr, X_STAGES: gl.constexpr,
                 x_layout: gl.constexpr):
    """Loop step ``it`` (chunk ``c0``) of x's ring: copy step it + X_STAGES - 1 into the slot every
    warp finished reading a step ago (the membar pass puts the CTA barrier before the copy and one
    after the wait), wait for step it's copies, and return its x tile in ``x_layout``."""
    return _x_ring_wait(x_ring, xc_ptrs, xc_mask, it, c0, c_last, KH, X_STAGES).load(x_layout)


@gluon.jit
def _kh_chunks(t, KH: gl.constexpr):
    """A tensor whose last dimension (size KH: 1, 2 or 4, held in registers) is the 64-K chunk of a
    step -> the KH tensors of one chunk each, in chunk order (register renaming, no data moves)."""
    if KH == 1:
        return (gl.reshape(t, t.shape[:-1]),)
    elif KH == 2:
        return gl.split(t)
    else:
        j0, j1 = gl.split(gl.reshape(t, t.shape[:-1] + [2, 2]))  # chunk 2 i + j
        c0, c2 = gl.split(j0)
        c1, c3 = gl.split(j1)
        return c0, c1, c2, c3


@gluon.jit
def _step_parts(w, s, KH: gl.constexpr, XC: gl.constexpr):
    """A step's words [KW, NB, KH, 32, 4] and scale pairs [KW, NB, KH, 32] as the parts the kernel
    decodes at once: the whole step, or (XC) its KH chunks, each [KW, NB, 1, 32, (4)]."""
    if XC:
        w_kc = _kh_chunks(gl.permute(w, [0, 1, 3, 4, 2]), KH)
        s_kc = _kh_chunks(gl.permute(s, [0, 1, 3, 2]), KH)
        w_parts = ()
        s_parts = ()
        for kc in gl.static_range(KH):
            w1 = gl.reshape(w_kc[kc], [w.shape[0], w.shape[1], 1, 32, 4])
            w_parts = w_parts + (w1,)
            s_parts = s_parts + (gl.convert_layout(gl.reshape(s_kc[kc], [s.shape[0], s.shape[1], 1, 32]),
                                                   gl.SliceLayout(4, w1.type.layout), assert_trivial=True),)
        return w_parts, s_parts
    else:
        return (w,), (s,)


@gluon.jit
def _x_part(x_slot, x_ptrs, x_k, K_X, c0, j, XK: gl.constexpr, X_STAGES: gl.constexpr, EVEN_K: gl.constexpr,
            x_layout: gl.constexpr):
    """x of part j (XK of K) of the step at chunk c0: from the ring's slot, or from global memory
    (stored K padded to 64: x past K_X reads zeros; the padded weights are zero too)."""
    if X_STAGES > 0:
        return x_slot.slice(j * XK, XK, dim=2).load(x_layout)
    elif EVEN_K:
        return gl.load(x_ptrs + c0 * 64 + j * XK)
    else:
        return gl.load(x_ptrs + c0 * 64 + j * XK, mask=x_k + c0 * 64 + j * XK < K_X, other=0.0)


@functools.cache  # launch arguments: built once per shape, not per call
def x_layout(block_m: int, kh: int, warps: int) -> gl.DistributedLinearLayout:
    """x tile [block_m, 64 kh] in stored K order: lane 4g + t reads token g (+ 8 per register
    repeat) and the 16 consecutive K at 16t of each 64-K chunk (two 16-byte loads); replicated
    over warps. Reordered to MMA order it is the B operand layout (asserted at the conversion)."""
    reg = [[0, 1], [0, 2], [0, 4], [0, 8]] + [[0, 64 << i] for i in range(kh.bit_length() - 1)] \
        + [[8 << i, 0] for i in range((block_m // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[0, 0]] * (warps.bit_length() - 1), block_bases=[],
                                      shape=[block_m, 64 * kh])


@gluon.jit
def fp4_linear_mma_kernel(
    wq_ptr,  # int32 words [N/16, K/64, 32, 4]
    sc_ptr,  # int16 scale pairs [N/16, K/64, 32] (NVFP4) or [N/16, K/64, 8, 2] (MXFP4)
    x_ptr,  # [M, K] bf16, (stride_xm, 1)
    wg_ptr,  # [1] fp32 weight global scale (HAS_WG), SWIGLU: WG_MODE's globals; else unused
    bias_ptr,  # [N] (HAS_BIAS; SWIGLU: [E, 2N], stride_be) or unused
    y_ptr,  # SPLIT_K == 1 and not GROUPED, or SWIGLU: [M, N] (stride_ym, 1); else [SPLIT_K, M, N] partial sums
    # (fp32; GROUPED may take bf16 rows, each sum rounded once)
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,  # GROUPED: the dispatch plan's tile map, else unused
    row_x_ptr,  # GROUPED and GATHER: [M] int32 x row of each sorted row, else unused
    M, N, K,  # K: the stored (padded) K, a multiple of 64; x is read (masked) up to K_X
    # GROUPED: M sorted rows (token-expert pairs), N rows per expert (the packed weight holds E * N;
    # SWIGLU: N outputs, E * 2N rows, each expert's N gate rows then its N up rows)
    K_X, stride_xm, stride_ym,
    k_chunks_per_split,  # 64-K chunks per split (a multiple of KH)
    stride_ge, stride_be,  # SWIGLU: row strides of per-row globals (WG_MODE 2) and of the bias, else 0
    RB: gl.constexpr,  # 16-row blocks per warp
    WARPS: gl.constexpr,  # warps along N (= num_warps)
    KH: gl.constexpr,  # 64-K chunks per loop step
    BLOCK_M: gl.constexpr,  # tokens per program (8 or a multiple of 16)
    MXFP4: gl.constexpr, HAS_WG: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr,
    FOLD: gl.constexpr,  # 2**(126 - F): what the decode leaves on its products
    DECODE: gl.constexpr,  # DECODE_ASM
    SCALE: gl.constexpr,  # scale_asm(MXFP4)
    X_LAYOUT: gl.constexpr,  # x_layout(BLOCK_M, KH, WARPS)
    EVEN_K: gl.constexpr,  # K_X == K (no padding along K)
    GROUPED: gl.constexpr,  # axis 1 runs over the tiles of an MoE dispatch plan (one expert each)
    GATHER: gl.constexpr,  # GROUPED: x rows through row_x_ptr (tokens), else the sorted rows themselves
    PDL: gl.constexpr,  # programmatic dependent launch (kernels.pdl): 1 wait for the previous grid before any
    # load; 2 (GROUPED) read the tile map and request the first weight step, then wait: the plan must come
    # from a kernel that completed before the previous one passed its wait (MoE GEMM 2, two kernels on);
    # 3 (GROUPED, X_STAGES > 0) independent of the previous kernel (the other class of the same GEMM,
    # MMAHeights), which itself waited for its own previous kernel before it let this one launch: let the next
    # launch at once, read and write without waiting (everything read was written two or more kernels back,
    # and no row written is the previous kernel's; what the previous kernels wrote comes through L2: x by
    # cp.async.cg, the tile map, gather map and globals by .cg loads), and the grid's last program waits for
    # the previous grid at its end, so that this grid completes after it (the next kernel's wait covers both).
    # (The kw kernel's PDL 3 is another thing: an L2 prefetch.)
    SWIGLU: gl.constexpr,  # GROUPED, SPLIT_K == 1: MoE GEMM 1 with its epilogue (globals, bias, silu(g) * u) fused
    WG_MODE: gl.constexpr,  # SWIGLU: 0 no globals, 1 one per expert [E], 2 one per weight row [E, 2N]
    X_STAGES: gl.constexpr,  # 0: each warp loads its x tile into registers at the start of each step;
    # >= 2 (EVEN_K, x rows 16-byte aligned): x through a shared-memory ring of X_STAGES steps filled by
    # cp.async X_STAGES - 1 steps ahead, copied once per program for all its warps
):
    """With SWIGLU each program also runs the expert's up rows (N row blocks below its gate rows)
    through a second accumulator of the same layout, so a thread holds the gate and the up sum of
    the same outputs and writes h = silu(g) * u in bf16 directly, as ``moe_partials_epilogue_kernel``
    computes it from the partial sums (no partial sums, no second kernel)."""
    BLOCK_N: gl.constexpr = 16 * RB * WARPS
    BLOCK_K: gl.constexpr = 64 * KH
    NB: gl.constexpr = RB * WARPS  # 16-row blocks per program

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # words: [row block, K chunk, lane, word]; each thread 4 consecutive words (one 16-byte load);
    # warps take the low row blocks, as in the MMA layout (RB repeats the tile in registers)
    w_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, KH, 1, 4], threads_per_warp=[1, 1, 32, 1],
                                              warps_per_cta=[WARPS, 1, 1, 1], order=[3, 2, 1, 0])
    s_layout: gl.constexpr = gl.SliceLayout(3, w_layout)
    x_layout: gl.constexpr = X_LAYOUT

    # PDL 3 reads what the chain wrote without a wait: through L2 (the tile map's loads always are)
    NO_WAIT_CACHE: gl.constexpr = ".cg" if PDL == 3 else ""
    if PDL == 1:
        _pdl_enter()
    if PDL == 3:
        _pdl_release()
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    KC = K // 64
    NRB = (N + 15) // 16
    c_start = pid_k * k_chunks_per_split
    c_end = gl.minimum(c_start + k_chunks_per_split, KC)
    if GROUPED:  # program axis 1: tile pid_m of the plan, rows [row_start, row_end) of expert e
        # through L2 (.cg): with PDL = 2 these loads run before the wait, and no L1 line may be stale
        e = gl.load(tile_expert_ptr + pid_m, cache_modifier=".cg")
        row_start = gl.where(e >= 0, gl.load(tile_start_ptr + pid_m, cache_modifier=".cg"), 0)  # unused tile
        row_end = gl.where(e >= 0, gl.load(tile_end_ptr + pid_m, cache_modifier=".cg"), row_start)  # (-1): row 0, no rows
        c_end = gl.where(e >= 0, c_end, c_start)  # ... and no K steps
        if SWIGLU:
            rb_base = gl.maximum(e, 0) * (2 * NRB)  # gate blocks, then as many up blocks
        else:
            rb_base = gl.maximum(e, 0) * NRB  # the expert's first row block in the stacked weight
    else:
        row_start = pid_m * BLOCK_M
        row_end = M
        rb_base = 0

    # pointers at chunk 0; each step adds the chunk offset (a scalar)
    i_rb, i_kc, i_lane, i_kl = _arange4(NB, KH, 32, 4, w_layout)
    rb = rb_base + gl.minimum(pid_n * NB + i_rb, NRB - 1)  # rows past N re-read the last block (never stored)
    w_ptrs = wq_ptr + ((rb.to(gl.int64) * KC + i_kc) * 32 + i_lane) * 4 + i_kl
    s_rb = rb_base + gl.minimum(pid_n * NB + gl.arange(0, NB, layout=gl.SliceLayout(1, gl.SliceLayout(2, s_layout))),
                                NRB - 1)
    s_kc = gl.arange(0, KH, layout=gl.SliceLayout(0, gl.SliceLayout(2, s_layout)))
    s_lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, s_layout)))
    s_blk = gl.expand_dims(gl.expand_dims(s_rb.to(gl.int64) * KC, 1) + gl.expand_dims(s_kc, 0), 2)
    if MXFP4:  # one pair per 32 K: [N/16, K/64, 8, 2]
        s_ptrs = sc_ptr + s_blk * 16 + gl.expand_dims(gl.expand_dims((s_lane // 4) * 2 + (s_lane % 4) // 2, 0), 1)
        S_STEP: gl.constexpr = 16
    else:  # one pair per 16 K: [N/16, K/64, 32]
        s_ptrs = sc_ptr + s_blk * 32 + gl.expand_dims(gl.expand_dims(s_lane, 0), 1)
        S_STEP: gl.constexpr = 32
    # rows past the tile re-read its last row (never stored): no masked loads in the loop
    offs_m = gl.minimum(row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout)),
                        gl.maximum(row_end - 1, 0))
    if GATHER:
        offs_m = gl.load(row_x_ptr + offs_m, cache_modifier=NO_WAIT_CACHE)
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_layout))
    x_ptrs = x_ptr + gl.expand_dims(offs_m.to(gl.int64) * stride_xm, 1) + gl.expand_dims(offs_k, 0)

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    w = gl.load(w_ptrs + c_start * 128)
    s = gl.load(s_ptrs + c_start * S_STEP)
    if SWIGLU:  # the up rows: NRB row blocks further on
        up_chunks = NRB.to(gl.int64) * KC
        w_ptrs_u = w_ptrs + up_chunks * 128
        s_ptrs_u = s_ptrs + up_chunks * S_STEP
        acc_u = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
        w_u = gl.load(w_ptrs_u + c_start * 128)
        s_u = gl.load(s_ptrs_u + c_start * S_STEP)
    if PDL == 2:  # x (the previous kernel's output) and every store come after the wait
        _pdl_enter()
    if X_STAGES > 0:
        # one 16-byte copy per thread and vector, the program's threads spread over the tile (copies
        # repeat only where it has fewer rows than the threads cover); 16-byte vectors XOR-swizzled by
        # row, so that the 8 lanes of a phase of x_layout's 16-byte reads (tokens g, g + 1; K 16t) hit
        # distinct banks
        TK: gl.constexpr = BLOCK_K // 8  # 8..32
        xc_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // TK, TK],
                                                   warps_per_cta=[WARPS, 1], order=[1, 0])
        xs_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
        x_ring = gl.allocate_shared_memory(gl.bfloat16, [X_STAGES, BLOCK_M, BLOCK_K], xs_layout)
        # rows past the tile are zero-filled, not copied: many threads copying one row (as the register
        # path's clamped rows do through L1) serialise on its L2 lines
        rows_c = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, xc_layout))
        offs_mc = gl.minimum(rows_c, gl.maximum(row_end - 1, 0))
        if GATHER:
            offs_mc = gl.load(row_x_ptr + offs_mc, cache_modifier=NO_WAIT_CACHE)
        xc_ptrs = x_ptr + gl.expand_dims(offs_mc.to(gl.int64) * stride_xm, 1) \
            + gl.expand_dims(gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, xc_layout)), 0)
        xc_mask = gl.expand_dims(rows_c < row_end, 1)
        c_last = gl.maximum(c_end - KH, c_start)  # steps past the end re-read the last (or, none, the first)
        _x_ring_fill(x_ring, xc_ptrs, xc_mask, c_start, c_last, KH, X_STAGES)
    for c0 in range(c_start, c_end, KH):
        if X_STAGES > 0:
            xt = _x_ring_step(x_ring, xc_ptrs, xc_mask, (c0 - c_start) // KH, c0, c_last, KH, X_STAGES, x_layout)
        elif EVEN_K:
            xt = gl.load(x_ptrs + c0 * 64)
        else:  # stored K padded to 64: x past K_X reads zeros (the padded weights are zero too)
            xt = gl.load(x_ptrs + c0 * 64, mask=gl.expand_dims(c0 * 64 + offs_k < K_X, 0), other=0.0)
        # the next step's weights are requested before this step's decoding (register double buffer)
        c_next = gl.minimum(c0 + KH, c_end - KH)
        w_next = gl.load(w_ptrs + c_next * 128)
        s_next = gl.load(s_ptrs + c_next * S_STEP)
        if SWIGLU:
            w_u_next = gl.load(w_ptrs_u + c_next * 128)
            s_u_next = gl.load(s_ptrs_u + c_next * S_STEP)
        wd = decode_a_operand(w, s, NB, KH, DECODE, SCALE, a_layout)
        # x from stored K order (kc, t, kl, i2, i0) to MMA order (kc, kl, i2, t, i0)
        xb = gl.permute(gl.reshape(xt, [BLOCK_M, KH, 4, 4, 2, 2]), [0, 1, 3, 4, 2, 5])
        xb = gl.convert_layout(gl.permute(gl.reshape(xb, [BLOCK_M, BLOCK_K]), [1, 0]), b_layout, assert_trivial=True)
        acc = mma_v2(wd, xb, acc)
        if SWIGLU:
            acc_u = mma_v2(decode_a_operand(w_u, s_u, NB, KH, DECODE, SCALE, a_layout), xb, acc_u)
            w_u = w_u_next
            s_u = s_u_next
        w = w_next
        s = s_next
    if X_STAGES > 0:
        async_copy.wait_group(0)  # no copy into the ring outlives the program

    out = acc
    if FOLD != 1.0:
        out = out * FOLD
    if HAS_WG and not SWIGLU:
        out = out * gl.load(wg_ptr)
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    offs_mo = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    n_mask = offs_n < N
    mask = gl.expand_dims(n_mask, 1) & gl.expand_dims(offs_mo < row_end, 0)
    rows = gl.expand_dims(offs_mo.to(gl.int64), 0)
    if SWIGLU:  # moe_partials_epilogue_kernel's arithmetic, in its order
        u = acc_u
        if FOLD != 1.0:
            u = u * FOLD
        e64 = gl.maximum(e, 0).to(gl.int64)  # an unused tile (e = -1) stores nothing
        if WG_MODE == 1:
            g_e = gl.load(wg_ptr + e64, cache_modifier=NO_WAIT_CACHE)
            out = out * g_e
            u = u * g_e
        if WG_MODE == 2:
            wg_e = wg_ptr + e64 * stride_ge
            out = out * gl.expand_dims(gl.load(wg_e + offs_n, mask=n_mask, other=0.0, cache_modifier=NO_WAIT_CACHE), 1)
            u = u * gl.expand_dims(gl.load(wg_e + N + offs_n, mask=n_mask, other=0.0, cache_modifier=NO_WAIT_CACHE), 1)
        if HAS_BIAS:
            b_e = bias_ptr + e64 * stride_be
            out = out + gl.expand_dims(gl.load(b_e + offs_n, mask=n_mask, other=0.0).to(gl.float32), 1)
            u = u + gl.expand_dims(gl.load(b_e + N + offs_n, mask=n_mask, other=0.0).to(gl.float32), 1)
        h = out / (1.0 + gl.exp(-out)) * u
        gl.store(y_ptr + rows * stride_ym + gl.expand_dims(offs_n, 1), h.to(y_ptr.dtype.element_ty), mask=mask)
    elif SPLIT_K == 1 and not GROUPED:
        if HAS_BIAS:
            bias = gl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(gl.float32)
            out = out + gl.expand_dims(bias, 1)
        gl.store(y_ptr + rows * stride_ym + gl.expand_dims(offs_n, 1), out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        part = y_ptr + (pid_k * M + rows) * N + gl.expand_dims(offs_n, 1)
        gl.store(part, out.to(y_ptr.dtype.element_ty), mask=mask)
    if PDL == 3:  # one program holds the grid's completion back until the previous grid's
        if (pid_n == gl.num_programs(0) - 1) & (pid_m == gl.num_programs(1) - 1) & (pid_k == gl.num_programs(2) - 1):
            _pdl_wait()


@functools.cache  # launch arguments: built once per shape, not per call
def x_layout_kw(block_m: int, kh: int, warps: int, kw: int) -> gl.DistributedLinearLayout:
    """``x_layout`` with a leading K-slice dimension: x tile [kw, block_m, 64 kh], slice s read by
    the warps of K group s (replicated over the ``warps`` along N)."""
    base = x_layout(block_m, kh, warps)
    reg = [[0] + b for b in base.reg_bases]
    lane = [[0] + b for b in base.lane_bases]
    warp = [[0, 0, 0]] * (warps.bit_length() - 1) + [[1 << i, 0, 0] for i in range(kw.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[],
                                      shape=[kw, block_m, 64 * kh])


@gluon.jit
def _arange5(n0: gl.constexpr, n1: gl.constexpr, n2: gl.constexpr, n3: gl.constexpr, n4: gl.constexpr,
             layout: gl.constexpr):
    """Index tensors of a 5-D ``layout``, each broadcastable to [n0, n1, n2, n3, n4]."""
    l4: gl.constexpr = gl.SliceLayout(4, layout)
    i0, i1, i2, i3 = _arange4(n0, n1, n2, n3, l4)
    i4 = gl.arange(0, n4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout)))))
    i4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(i4, 0), 1), 2), 3)
    return gl.expand_dims(i0, 4), gl.expand_dims(i1, 4), gl.expand_dims(i2, 4), gl.expand_dims(i3, 4), i4


@gluon.jit
def fp4_linear_mma_kw_kernel(
    wq_ptr, sc_ptr, x_ptr, wg_ptr, bias_ptr,
    y_ptr,  # [M, N] (stride_ym, 1)
    M, N, K, K_X, stride_xm, stride_ym,
    k_chunks_per_slice,  # KC / KW 64-K chunks per K slice (a multiple of KH); slice s starts at s * k_chunks_per_slice
    RB: gl.constexpr, WARPS: gl.constexpr, KW: gl.constexpr, KH: gl.constexpr, BLOCK_M: gl.constexpr,
    MXFP4: gl.constexpr, HAS_WG: gl.constexpr, HAS_BIAS: gl.constexpr, FOLD: gl.constexpr,
    DECODE: gl.constexpr, SCALE: gl.constexpr, X_LAYOUT: gl.constexpr,
    EVEN_K: gl.constexpr,  # K_X == K
    PDL: gl.constexpr,  # programmatic dependent launch: 0 off; 1 wait for the previous grid before any
    # load; 2 request the first weight step, then wait (the previous kernel must not write the weights);
    # 3 as 2, and first request the program's whole share of weights and scales into L2 (bulk prefetch)
    X_STAGES: gl.constexpr,  # 0 or a ring of x steps in shared memory, per K slice (``fp4_linear_mma_kernel``'s)
    XC: gl.constexpr = False,  # x read per 64-K chunk just before its MMA (X_LAYOUT then that of one chunk)
    XA: gl.constexpr = False,  # with XC, x read one chunk ahead of its MMA (two chunks' registers; X_STAGES 0)
    PF: gl.constexpr = 0,  # > 0 (SM90+): each step requests the weights PF steps ahead into L2 (MMAConfig.pf)
):
    """``fp4_linear_mma_kernel`` with K split over the warps of one program instead of over programs:
    KW groups of WARPS warps each sum a K slice of the same BLOCK_N x BLOCK_M tile, and the program
    adds the KW partial tiles (a cross-warp reduction in a fixed order) before the epilogue. No
    partial sums leave the program, so there is no second kernel."""
    BLOCK_N: gl.constexpr = 16 * RB * WARPS
    BLOCK_K: gl.constexpr = 64 * KH
    NB: gl.constexpr = RB * WARPS

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[KW, WARPS, 1], instr_shape=[1, 16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    w_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, KH, 1, 4], threads_per_warp=[1, 1, 1, 32, 1],
                                              warps_per_cta=[KW, WARPS, 1, 1, 1], order=[4, 3, 2, 1, 0])
    s_layout: gl.constexpr = gl.SliceLayout(4, w_layout)
    x_layout: gl.constexpr = X_LAYOUT

    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    KC = K // 64
    NRB = (N + 15) // 16
    row_start = pid_m * BLOCK_M

    # words [slice, row block, chunk, lane, word]; slice s starts at chunk s * k_chunks_per_slice
    i_s, i_rb, i_kc, i_ln, i_kl = _arange5(KW, NB, KH, 32, 4, w_layout)
    rb = gl.minimum(pid_n * NB + i_rb, NRB - 1)  # rows past N re-read the last block (never stored)
    w_ptrs = wq_ptr + ((rb.to(gl.int64) * KC + i_s * k_chunks_per_slice + i_kc) * 32 + i_ln) * 4 + i_kl
    j_s, j_rb, j_kc, j_ln = _arange4(KW, NB, KH, 32, s_layout)
    s_blk = gl.minimum(pid_n * NB + j_rb, NRB - 1).to(gl.int64) * KC + j_s * k_chunks_per_slice + j_kc
    if MXFP4:  # one pair per 32 K: [N/16, K/64, 8, 2]
        s_ptrs = sc_ptr + s_blk * 16 + (j_ln // 4) * 2 + (j_ln % 4) // 2
        S_STEP: gl.constexpr = 16
    else:  # one pair per 16 K: [N/16, K/64, 32]
        s_ptrs = sc_ptr + s_blk * 32 + j_ln
        S_STEP: gl.constexpr = 32

    # x [slice, token, K of the step]
    lx_s: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, x_layout))
    lx_m: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, x_layout))
    lx_k: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, x_layout))
    CK: gl.constexpr = 1 if XC else KH  # 64-K chunks per x load and MMA
    XK: gl.constexpr = 64 * CK
    offs_m = gl.minimum(row_start + gl.arange(0, BLOCK_M, layout=lx_m), M - 1)
    x_k = gl.expand_dims(gl.expand_dims(gl.arange(0, KW, layout=lx_s) * (k_chunks_per_slice * 64), 1), 2) \
        + gl.expand_dims(gl.expand_dims(gl.arange(0, XK, layout=lx_k), 0), 1)  # [KW, 1, XK]
    x_ptrs = x_ptr + gl.expand_dims(gl.expand_dims(offs_m.to(gl.int64) * stride_xm, 0), 2) + x_k

    acc = gl.zeros([KW, BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    c_last = k_chunks_per_slice - KH
    if PDL == 3:
        # each (K slice, row block) run of words is contiguous (k_chunks_per_slice x 512 B): lane l
        # requests its 1/32 of it, lane 0 the run's scales; the loop then finds them in L2
        pf_layout: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 1, 32], [KW, WARPS, 1], [2, 1, 0])
        p_s = gl.arange(0, KW, layout=gl.SliceLayout(1, gl.SliceLayout(2, pf_layout)))
        p_rb = gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(2, pf_layout)))
        p_ln = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, pf_layout)))
        p_s = gl.expand_dims(gl.expand_dims(p_s, 1), 2)
        p_rb = gl.expand_dims(gl.expand_dims(p_rb, 0), 2)
        p_ln = gl.expand_dims(gl.expand_dims(p_ln, 0), 1)
        run = gl.minimum(pid_n * NB + p_rb, NRB - 1).to(gl.int64) * KC + p_s * k_chunks_per_slice  # first chunk
        _l2_prefetch(wq_ptr + run * 128 + p_ln * (k_chunks_per_slice * 4), k_chunks_per_slice * 16, p_ln >= 0)
        _l2_prefetch(sc_ptr + run * S_STEP, k_chunks_per_slice * S_STEP * 2, p_ln == 0)
    if PF > 1:  # steps 1 .. PF - 1, requested before the loop (which requests step PF on)
        n_pf = gl.minimum((PF - 1) * KH, k_chunks_per_slice - KH)
    if PDL >= 2:  # the weights are not written by the kernel before: their first step is requested early
        w = gl.load(w_ptrs)
        s = gl.load(s_ptrs)
        if PF > 1:
            _l2_prefetch_runs(wq_ptr, sc_ptr, pid_n * NB, NRB - 1, KC, k_chunks_per_slice, KH, n_pf, n_pf > 0,
                              WARPS, RB, S_STEP)
    if PDL != 0:  # nothing the previous kernel writes (x, y's memory) is touched before it completes
        _pdl_enter()
    if PDL < 2:
        w = gl.load(w_ptrs)
        s = gl.load(s_ptrs)
        if PF > 1:
            _l2_prefetch_runs(wq_ptr, sc_ptr, pid_n * NB, NRB - 1, KC, k_chunks_per_slice, KH, n_pf, n_pf > 0,
                              WARPS, RB, S_STEP)
    if X_STAGES > 0:  # as in fp4_linear_mma_kernel, one ring slot [KW, BLOCK_M, BLOCK_K] per step
        TK: gl.constexpr = BLOCK_K // 8
        xc_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[1, 32 // TK, TK],
                                                   warps_per_cta=[KW, WARPS, 1], order=[2, 1, 0])
        xs_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0])
        x_ring = gl.allocate_shared_memory(gl.bfloat16, [X_STAGES, KW, BLOCK_M, BLOCK_K], xs_layout)
        lc_s: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, xc_layout))
        lc_m: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, xc_layout))
        lc_k: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, xc_layout))
        rows_c = row_start + gl.arange(0, BLOCK_M, layout=lc_m)
        xc_ptrs = x_ptr + gl.expand_dims(gl.expand_dims(gl.minimum(rows_c, M - 1).to(gl.int64) * stride_xm, 0), 2) \
            + gl.expand_dims(gl.expand_dims(gl.arange(0, KW, layout=lc_s) * (k_chunks_per_slice * 64), 1), 2) \
            + gl.expand_dims(gl.expand_dims(gl.arange(0, BLOCK_K, layout=lc_k), 0), 1)
        xc_mask = gl.expand_dims(gl.expand_dims(rows_c < M, 0), 2)  # rows past M zero-filled, not copied
        _x_ring_fill(x_ring, xc_ptrs, xc_mask, 0, c_last, KH, X_STAGES)
    gl.static_assert((not XA) or (XC and X_STAGES == 0), "x a chunk ahead: x per chunk, in registers")
    if XA:  # the first chunk's x; each chunk then requests the next one's before its decode and MMA
        xt = _x_part(None, x_ptrs, x_k, K_X, 0, 0, XK, 0, EVEN_K, x_layout)
    for c0 in range(0, k_chunks_per_slice, KH):
        # x per step, or with XC per chunk: the step's weights split by register renaming, then x,
        # decode and MMA one part at a time (x holds a part's registers, not a step's)
        if X_STAGES > 0:
            x_slot = _x_ring_wait(x_ring, xc_ptrs, xc_mask, c0 // KH, c0, c_last, KH, X_STAGES)
        else:
            x_slot = None
        if not XC:  # the step's x is requested before the next step's weights
            xt = _x_part(x_slot, x_ptrs, x_k, K_X, c0, 0, XK, X_STAGES, EVEN_K, x_layout)
        if PF > 0:  # the step PF steps ahead into L2
            c_pf = c0 + PF * KH
            _l2_prefetch_runs(wq_ptr, sc_ptr, pid_n * NB, NRB - 1, KC, k_chunks_per_slice, c_pf, KH,
                              c_pf < k_chunks_per_slice, WARPS, RB, S_STEP)
        c_next = gl.minimum(c0 + KH, c_last)
        w_next = gl.load(w_ptrs + c_next * 128)
        s_next = gl.load(s_ptrs + c_next * S_STEP)
        w_parts, s_parts = _step_parts(w, s, KH, XC)
        for j in gl.static_range(KH // CK):
            if XA:  # the next chunk's x: this step's next, or the next step's first (the last step re-reads its own)
                if j + 1 < KH:
                    x_ahead = _x_part(None, x_ptrs, x_k, K_X, c0, j + 1, XK, 0, EVEN_K, x_layout)
                else:
                    x_ahead = _x_part(None, x_ptrs, x_k, K_X, c_next, 0, XK, 0, EVEN_K, x_layout)
            elif XC:
                xt = _x_part(x_slot, x_ptrs, x_k, K_X, c0, j, XK, X_STAGES, EVEN_K, x_layout)
            wd = decode_a_operand_kw(w_parts[j], s_parts[j], KW, NB, CK, DECODE, SCALE, a_layout)
            xb = gl.permute(gl.reshape(xt, [KW, BLOCK_M, CK, 4, 4, 2, 2]), [0, 1, 2, 4, 5, 3, 6])
            xb = gl.convert_layout(gl.permute(gl.reshape(xb, [KW, BLOCK_M, XK]), [0, 2, 1]), b_layout,
                                   assert_trivial=True)
            acc = mma_v2(wd, xb, acc)
            if XA:
                xt = x_ahead
        w = w_next
        s = s_next
    if X_STAGES > 0:
        async_copy.wait_group(0)

    out = gl.sum(acc, axis=0)
    if FOLD != 1.0:
        out = out * FOLD
    if HAS_WG:
        out = out * gl.load(wg_ptr)
    o_layout: gl.constexpr = gl.SliceLayout(0, mma)
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, o_layout))
    offs_mo = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, o_layout))
    n_mask = offs_n < N
    mask = gl.expand_dims(n_mask, 1) & gl.expand_dims(offs_mo < M, 0)
    if HAS_BIAS:
        bias = gl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(gl.float32)
        out = out + gl.expand_dims(bias, 1)
    gl.store(y_ptr + gl.expand_dims(offs_mo.to(gl.int64), 0) * stride_ym + gl.expand_dims(offs_n, 1),
             out.to(y_ptr.dtype.element_ty), mask=mask)
