"""Prefill on Hopper: the wgmma kernel with the packed weights as the register operand
(``kernels.gemm_wgmma``): its configuration (``WgmmaConfig``, ``choose_wgmma_config``), the pass of
the activations into the weights' MMA K order (``mma_order_rows``), the TMA descriptors, the shared
memory model and the launchers (plain linear, MoE grouped GEMMs). Weights come packed by
``ops.mma_pack``; the warp-specialized variant (``WgmmaConfig.ws``) lives in ``ops.experimental``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from ..formats import NVFP4, FP4Format
from ..tuning import current_tuning
from ._runtime import arch_kwargs, pdl_enabled
from .mma_pack import KCHUNK, ROWS, MMAPackedFP4, _scale_pairs_per_chunk, _weights_before_wait
from .mma_sync import MAX_M

def _split_pdl(splits: int, has_pdl: bool) -> bool:
    """Whether a plain wgmma launch of ``splits`` K splits chains its pass and GEMM by PDL
    (``LinearTuning.split_pdl``)."""
    return current_tuning().linear.split_pdl and splits > 1 and has_pdl


@dataclass(frozen=True)
class WgmmaConfig:
    """Launch parameters of ``fp4_gemm_wgmma_kernel``: ``warps`` 4 or 8 (one or two warpgroups),
    ``repeats`` 16-row weight blocks per warp (2: 32 * warps weight rows per program, the gate and
    up halves of MoE GEMM 1 in one thread; 1: 16 * warps rows, so that a 256-row activation tile
    still fits the registers), ``block_m`` activation rows per program (the wgmma N side; the
    accumulator holds repeats * block_m / 2 fp32 registers per thread, at most 128), ``stages``
    activation ring depth, ``group_m`` activation tiles per raster group (plain linear only),
    ``tail_m`` (MoE only; 0 = off) the height at which a tile of at most that many rows, an
    expert's short last tile, runs with narrower wgmmas; ``split_k`` (plain linear, not ``ws``)
    programs sharing one output tile along K, whose fp32 partials ``splitk_reduce_kernel`` adds in
    a fixed order (small M: more programs and more weight bytes in flight than the output tiles
    give); ``ws`` the warp-specialized kernel
    (``kernels.gemm_ws``: a decode warpgroup writes the bf16 weight tile to shared memory for the
    ``warps`` = 8 MMA warps; ``stages`` is then its TMA ring, plus ``ops.experimental.WS_A_STAGES``
    decoded tiles; an opt-in path no default reaches);
    ``persistent`` (plain linear, 256-row tiles of two warpgroups, no split-K) one program per SM
    computing tiles one after the other through one ring (``kernels.gemm_wgmma._gemm_persistent``;
    the launcher runs a program per tile instead where K has fewer than ``stages`` - 2 chunks);
    ``merge_tail`` (MoE, with ``tail_m``) an expert's full tile followed by its short last tile runs
    both: the same decoded weights feed a second, ``tail_m``-row wgmma per chunk, so the short
    tile's weights are neither read nor decoded a second time (its own programs do nothing)."""

    block_m: int = 128
    stages: int = 4
    group_m: int = 8
    warps: int = 4
    repeats: int = 2
    tail_m: int = 0
    split_k: int = 1
    ws: bool = False
    persistent: bool = False
    merge_tail: bool = False

    def __post_init__(self) -> None:
        if self.block_m not in (16, 32, 64, 128, 256):
            raise ValueError(f"WgmmaConfig.block_m: expected 16, 32, 64, 128 or 256, got {self.block_m}")
        if not 1 <= self.split_k <= 64:
            raise ValueError(f"WgmmaConfig.split_k: expected 1..64, got {self.split_k}")
        if self.split_k > 1 and (self.tail_m or self.ws):
            raise ValueError(f"WgmmaConfig.split_k: the plain linear of the register-A kernel splits K, not the MoE "
                             f"tails (tail_m) or the warp-specialized kernel (ws), got {self}")
        if not 3 <= self.stages <= 8:
            raise ValueError(f"WgmmaConfig.stages: expected 3..8, got {self.stages}")
        if self.warps not in (4, 8):
            raise ValueError(f"WgmmaConfig.warps: expected 4 or 8, got {self.warps}")
        if not 1 <= self.group_m <= 64:
            raise ValueError(f"WgmmaConfig.group_m: expected 1..64, got {self.group_m}")
        if self.repeats not in (1, 2):
            raise ValueError(f"WgmmaConfig.repeats: expected 1 or 2, got {self.repeats}")
        if self.repeats * self.block_m > 256:
            raise ValueError(f"WgmmaConfig: block_m {self.block_m} with repeats {self.repeats} needs "
                             f"{self.repeats * self.block_m // 2} accumulator registers per thread (at most 128); "
                             "use repeats=1 for 256-row tiles")
        if self.tail_m not in (0, 32, 64, 128) or (self.tail_m and self.tail_m >= self.block_m):
            raise ValueError(f"WgmmaConfig.tail_m: expected 0, or 32, 64 or 128 below block_m {self.block_m}, "
                             f"got {self.tail_m}")
        if self.ws and (self.warps, self.repeats, self.tail_m) != (8, 1, 0):
            raise ValueError(f"WgmmaConfig.ws: the warp-specialized kernel has 8 MMA warps of one repeat and no "
                             f"tail tiles, got warps={self.warps} repeats={self.repeats} tail_m={self.tail_m}")
        if self.persistent and ((self.block_m, self.warps, self.repeats) != (256, 8, 1) or self.split_k > 1
                                or self.tail_m or self.ws):
            raise ValueError(f"WgmmaConfig.persistent: 256-row tiles of two warpgroups of one repeat (one program "
                             f"per SM; shorter tiles fit two programs per SM, which one persistent program would "
                             f"halve), without split_k, tail_m or ws, got {self}")
        if self.merge_tail and not self.tail_m:
            raise ValueError(f"WgmmaConfig.merge_tail: merges an expert's short last tile (tail_m rows) into the tile "
                             f"before it, so it needs tail_m, got {self}")
        if self.ws:
            from .experimental import WS_A_STAGES

            if self.stages <= WS_A_STAGES:
                raise ValueError(f"WgmmaConfig.stages: the warp-specialized kernel's TMA ring must be deeper than its "
                                 f"{WS_A_STAGES} decoded tiles (the copies' lead is the difference), got {self.stages}")

    @property
    def block_n(self) -> int:
        """Weight rows per program."""
        return 16 * self.repeats * self.warps

    def with_tail(self, tail_m: int, block_m: int | None = None) -> WgmmaConfig:
        """This configuration with ``tail_m``-row tails (0: none) and optionally another ``block_m``;
        merged tails stay on only while there are tails to merge."""
        return replace(self, block_m=self.block_m if block_m is None else block_m, tail_m=tail_m,
                       merge_tail=self.merge_tail and tail_m > 0)

    def __str__(self) -> str:
        tail = ("" if self.repeats == 2 else f"_r{self.repeats}") + (f"_t{self.tail_m}" if self.tail_m else "") \
            + (f"_split{self.split_k}" if self.split_k > 1 else "") + ("_ws" if self.ws else "") \
            + ("_p" if self.persistent else "") + ("_mt" if self.merge_tail else "")
        return f"wgmma_n{self.block_n}_m{self.block_m}_s{self.stages}_g{self.group_m}{tail}"

    @classmethod
    def parse(cls, name: str) -> WgmmaConfig:
        """The configuration ``str`` names (benchmark and sweep records), e.g. ``wgmma_n128_m256_s4_g8_r1``."""
        m = re.fullmatch(r"wgmma_n(\d+)_m(\d+)_s(\d+)_g(\d+)(?:_r(\d))?(?:_t(\d+))?(?:_split(\d+))?(_ws)?(_p)?(_mt)?",
                         name)
        repeats = int(m[5] or 2) if m else 2
        if not m or int(m[1]) % (16 * repeats):
            raise ValueError(f"WgmmaConfig.parse: not a configuration name: {name!r}")
        return cls(block_m=int(m[2]), stages=int(m[3]), group_m=int(m[4]), warps=int(m[1]) // (16 * repeats),
                   repeats=repeats, tail_m=int(m[6] or 0), split_k=int(m[7] or 1), ws=bool(m[8]),
                   persistent=bool(m[9]), merge_tail=bool(m[10]))


#: the smallest batch the plain linear runs on the wgmma kernel (SM90); at MAX_M and below the
#: mma.sync decode kernel (docs/performance-engineering.md, ``WGMMA_MIN_M``)
WGMMA_MIN_M = MAX_M + 1


#: relative time of one program by activation tile height (two warpgroups of one repeat), a cost
#: model fitted on the H200 (docs/performance-engineering.md, ``_WGMMA_TILE_COST``)
_WGMMA_TILE_COST = {256: 100, 128: 56, 64: 36}


def choose_wgmma_config(M: int, N: int, K: int, sm_count: int = 132) -> WgmmaConfig:
    """Two warpgroups of 64 weight rows each (128 per program, one register repeat) and the
    activation tile height, of 64, 128 or 256 rows, with the least waves x tile cost: the
    programs' count over the SMs, rounded up, times the program's relative time
    (``_WGMMA_TILE_COST``; taller tiles decode each weight once for more rows). 256-row tiles run
    persistent (one program per SM); shorter tiles keep a program per tile: two of them share an
    SM, which one persistent program of their registers would not.

    Small batches (M <= ``LinearTuning.wgmma_split_max_m``) are bound by the weight stream, which
    one tile row of programs cannot keep busy: one warpgroup of two repeats (128 weight rows) over a
    32- or 64-row tile, K split over the most programs up to ``wgmma_split_programs_per_sm`` per SM,
    each keeping at least ``wgmma_split_min_chunks`` chunks (docs/performance-engineering.md,
    ``LinearTuning.wgmma_split_max_m``)."""
    tune = current_tuning().linear
    if M <= tune.wgmma_split_max_m:
        block_m = 32 if M <= 32 else 64
        programs = -(-M // block_m) * -(-N // 128)
        chunks = -(-K // KCHUNK)
        split = max([s for s in (1, 2, 3, 4, 6, 8) if programs * s <= tune.wgmma_split_programs_per_sm * sm_count
                     and chunks // s >= tune.wgmma_split_min_chunks] or [1])
        return WgmmaConfig(block_m=block_m, stages=4, warps=4, repeats=2, split_k=split)
    tiles_n = -(-N // 128)

    def cost(bm: int) -> tuple[int, int]:
        waves = -(-(-(-M // bm) * tiles_n) // max(sm_count, 1))
        return waves * _WGMMA_TILE_COST[bm], -bm

    return persistent_where_possible(WgmmaConfig(block_m=min(_WGMMA_TILE_COST, key=cost), stages=4, group_m=8,
                                                 warps=8, repeats=1), K)


def persistent_where_possible(config: WgmmaConfig, K: int) -> WgmmaConfig:
    """``config`` as the plain linear runs it on a weight of K columns: 256-row tiles of two
    warpgroups of one repeat run persistent where K has at least ``stages`` - 2 chunks (a ring
    refill then reaches at most into the next tile, what ``_gemm_persistent`` assumes), every other
    configuration a program per tile. The heuristic, the launcher and the planner's candidates
    all ask here."""
    can = (config.block_m, config.warps, config.repeats, config.split_k, config.tail_m, config.ws) == (256, 8, 1, 1, 0,
                                                                                                       False)
    return replace(config, persistent=can and -(-K // KCHUNK) >= config.stages - 2)


def _x_pairs(x2: torch.Tensor) -> torch.Tensor:
    """bf16 activations [rows, K] as int32 pairs (what ``mma_order_rows`` moves)."""
    if x2.dtype != torch.bfloat16:
        raise TypeError(f"x: the wgmma kernel takes bfloat16 activations, got {x2.dtype}")
    if x2.stride(-1) != 1 or x2.stride(0) % 2 or x2.shape[1] % 2 or x2.data_ptr() % 4:
        x2 = x2.contiguous()
    return x2.view(torch.int32)


def mma_order_rows(x2: torch.Tensor, k_stored: int, rows: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, *, pdl: bool = False) -> torch.Tensor:
    """Activations [M, K_X] bf16 -> [R, k_stored] in the packed weights' MMA K order (each 64-K
    chunk's bf16 pairs permuted as ``pack_mma`` permutes the weights' K; K past K_X zero): the
    layout the wgmma kernel's TMA copies into shared memory as it is. ``rows`` [R] int32 gathers
    (MoE GEMM 1: the dispatch plan's sorted_token, whose -1 rows, dropped pairs, come out zero);
    otherwise R = M. One pass over the data. ``pdl``: launched with programmatic dependent launch
    (``kernels.pdl``; the caller checks the device has it)."""
    import triton

    from ..kernels.gemm_wgmma import mma_order_rows_kernel

    if k_stored % KCHUNK or k_stored < x2.shape[1]:
        raise ValueError(f"k_stored: expected a multiple of {KCHUNK} >= K = {x2.shape[1]}, got {k_stored}")
    if rows is not None:
        if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64) or rows.device != x2.device:
            raise ValueError(f"rows: expected a 1-D int32/int64 tensor on {x2.device}, got {rows.dtype} "
                             f"{tuple(rows.shape)} on {rows.device}")
        rows = rows.contiguous()
    xp = _x_pairs(x2)
    R = x2.shape[0] if rows is None else rows.shape[0]
    if out is None:
        out = torch.empty((R, k_stored), dtype=torch.bfloat16, device=x2.device)
    elif tuple(out.shape) != (R, k_stored) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous bf16 [{R}, {k_stored}], got {out.dtype} {tuple(out.shape)}")
    if R == 0:
        return out
    op = out.view(torch.int32)
    block_r, block_q = 16, 128 if k_stored % 256 == 0 else 32
    mma_order_rows_kernel[(triton.cdiv(R, block_r), k_stored // 2 // block_q)](
        xp, rows if rows is not None else xp, op, R, x2.shape[1], xp.stride(0), op.stride(0),
        GATHER=rows is not None, BLOCK_R=block_r, BLOCK_Q=block_q, num_warps=4, PDL=int(pdl), launch_pdl=pdl,
        **arch_kwargs(op.device))
    return out


def _x_desc(xm: torch.Tensor, block_m: int):
    """TMA descriptor of activations in MMA K order [R, K]: [block_m, 64] tiles in the 128-byte
    swizzle that wgmma reads (rows past R are zero-filled by the copy)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if (xm.dtype != torch.bfloat16 or xm.dim() != 2 or xm.stride(1) != 1 or (xm.stride(0) * 2) % 16
            or xm.data_ptr() % 16 or xm.shape[1] % KCHUNK):
        raise ValueError(f"activations for TMA: expected bf16 [R, K] with K a multiple of {KCHUNK}, 16-byte aligned "
                         f"rows and base, got {xm.dtype} {tuple(xm.shape)} strides {tuple(xm.stride())}")
    return TensorDescriptor.from_tensor(xm, [block_m, KCHUNK], _x_smem_layout())


def _w_smem_layout():
    """The weight-word ring's shared layout: plain rows of 128 int32 (each thread reads its own 16
    bytes back), the layout TMA copies them in."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def _w_box_rows(config: WgmmaConfig, swiglu: bool) -> int:
    """16-row weight blocks per TMA box: the program's blocks, or for GEMM 1 its gate half (the up
    half is a second copy from I / 16 blocks further)."""
    nb = config.repeats * config.warps
    return nb // 2 if swiglu else nb


def _w_desc(p: MMAPackedFP4, rows: int):
    """TMA descriptor of the packed weight words as [blocks, K/64 * 128] int32, [rows, 128] boxes
    (one chunk of ``rows`` 16-row blocks; blocks past the end read as zeros)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    words = p.words.reshape(p.words.shape[0], -1)
    return TensorDescriptor.from_tensor(words, [rows, 128], _w_smem_layout())


def _s_desc(p: MMAPackedFP4, rows: int):
    """TMA descriptor of the scale pairs as [blocks, K/64 * S] int16 (S = 32 per 64-K chunk for
    NVFP4, 16 for MXFP4), [rows, S] boxes: one chunk of ``rows`` 16-row blocks."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    sc = p.scales.view(torch.int16).reshape(p.scales.shape[0], -1)
    return TensorDescriptor.from_tensor(sc, [rows, _scale_pairs_per_chunk(p.fmt)], _s_smem_layout())


def _s_smem_layout():
    """The scale-pair ring's shared layout: plain int16 rows, as TMA copies them."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


def _decode_consts(fmt: FP4Format | str, order: str = "nibble") -> dict:
    """The FP4 decode constexprs of the wgmma kernels for ``fmt`` (MXFP4 flag, scale fold, asm)."""
    from ..formats import get_format
    from ..kernels.linear_mma import FOLD_E4M3, FOLD_E8M0, decode_asm, scale_asm

    mx = get_format(fmt) is not NVFP4
    return dict(MXFP4=mx, FOLD=FOLD_E8M0 if mx else FOLD_E4M3, DECODE=decode_asm(order), SCALE=scale_asm(mx))


def _x_smem_layout():
    """The activation tile's shared layout: the 128-byte swizzle wgmma reads its B operand in."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def wgmma_smem_terms(config: WgmmaConfig, fmt: FP4Format | str) -> list[tuple[str, int, int]]:
    """(name, bytes each, count) of the wgmma kernel's shared memory: the activation, weight-word
    and scale-pair rings (all TMA tiles) and one mbarrier per stage. The epilogue works from
    registers; a ``tail_m`` variant's buffers reuse the same bytes, and a ``merge_tail`` tile's
    activation ring holds the tail's rows too. Checked against compiled kernels in the tests."""
    nb = config.repeats * config.warps  # 16-row weight blocks per program
    rows = config.block_m + (config.tail_m if config.merge_tail else 0)
    return [("activation tile (TMA)", rows * KCHUNK * 2, config.stages),
            ("weight words (TMA)", nb * 32 * 4 * 4, config.stages),
            ("scale pairs (TMA)", nb * _scale_pairs_per_chunk(fmt) * 2, config.stages),
            ("mbarrier", 8, config.stages)]


def launch_linear_wgmma(x2: torch.Tensor, p: MMAPackedFP4, bias: torch.Tensor | None, out: torch.Tensor,
                        config: WgmmaConfig = WgmmaConfig(), *, x_mma_order: bool = False,
                        max_programs: int | None = None) -> torch.Tensor:
    """``out[M, N] = x2[M, K] @ W^T (+ bias)`` on SM90 (wgmma; compiled CUDA only): two launches,
    the pass into MMA K order (``mma_order_rows``) and the GEMM, and with ``config.split_k`` a third,
    the reduction of the fp32 partials (bias and cast there). ``x_mma_order``: x2 already is
    [M, K stored] in MMA K order, contiguous (``ops.quantize.dequantize_activations(k_stored=...)``),
    and the first pass is skipped. ``max_programs``: a persistent configuration's grid (default one
    program per SM; the tests use fewer to give each program many tiles)."""
    import triton

    from ..kernels.gemm_wgmma import fp4_gemm_wgmma_kernel

    if config.tail_m:
        raise ValueError(f"config: tail_m is for the MoE GEMMs, got {config}")
    if max_programs is not None and (not isinstance(max_programs, int) or max_programs < 1):
        raise ValueError(f"max_programs: expected a positive int or None, got {max_programs!r}")
    M, N = x2.shape[0], p.shape[0]
    k_stored = p.words.shape[1] * KCHUNK
    if M == 0:
        return out
    if x_mma_order and (tuple(x2.shape) != (M, k_stored) or x2.dtype != torch.bfloat16 or not x2.is_contiguous()):
        raise ValueError(f"x2: x_mma_order needs a contiguous bf16 [{M}, {k_stored}], got {x2.dtype} {tuple(x2.shape)}")
    split, per_split = wgmma_split(config, p.words.shape[1])
    # split-K (small batches, where launch gaps weigh most): the pass and the GEMM chained by programmatic
    # dependent launch, the GEMM requesting its first weights before its wait (``LinearTuning.split_pdl``). The pass waits for the kernel before it to complete before it lets the GEMM launch, so
    # whatever wrote the weights has finished; with x already in MMA order the GEMM follows that kernel
    # directly, and on a pack's first launch it waits before any load
    pdl = _split_pdl(split, bool(pdl_enabled(out.device)))
    gemm_pdl = 0
    if pdl:
        gemm_pdl = _weights_before_wait(p, 2) if x_mma_order else 2
    x_desc = _x_desc(x2 if x_mma_order else mma_order_rows(x2, k_stored, pdl=pdl), config.block_m)
    tiles_m = triton.cdiv(M, config.block_m)
    unused = p.scales  # pointer arguments the plain variant does not read (Triton needs a tensor)
    w_desc = _w_desc(p, _w_box_rows(config, False))
    target = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=out.device)
    fused_bias = bias if split == 1 else None
    rest = (p.global_scale if p.global_scale is not None else unused,
            fused_bias if fused_bias is not None else unused, target,
            unused, unused, unused, unused, unused, M, N, k_stored, target.stride(-2), 0, 0, tiles_m)
    consts = dict(BLOCK_M=config.block_m, STAGES=config.stages, WG_MODE=1 if p.global_scale is not None else 0,
                  HAS_BIAS=fused_bias is not None, GROUPED=False, SCATTER=False, HAS_RW=False,
                  GROUP_M=config.group_m, WARPS=config.warps, **_decode_consts(p.fmt, p.order))
    grid = (tiles_m * triton.cdiv(N, config.block_n), split)
    if config.persistent:
        config = persistent_where_possible(config, k_stored)
    if config.persistent:  # one program of two warpgroups per SM (registers), each over its share of the tiles
        programs = max_programs or torch.cuda.get_device_properties(out.device).multi_processor_count
        grid = (min(grid[0], programs), 1)
    if config.ws:
        from .experimental import launch_ws

        launch_ws(grid, w_desc, _s_desc(p, config.block_n // ROWS), x_desc, rest, consts, config, out)
        return out
    fp4_gemm_wgmma_kernel[grid](w_desc, _s_desc(p, _w_box_rows(config, False)), x_desc, x_desc, *rest, per_split,
                                SWIGLU=0,
                                ALPHA=0.0, LIMIT=0.0, OUT_MMA_ORDER=False, REPEATS=config.repeats, TAIL_M=0,
                                PERSISTENT=config.persistent, num_warps=config.warps, PDL=gemm_pdl,
                                launch_pdl=pdl, **consts, **arch_kwargs(out.device))
    if split > 1:
        from .split_k import reduce_splits

        reduce_splits(target, bias, out)
    return out


def wgmma_split(config: WgmmaConfig, chunks: int) -> tuple[int, int]:
    """(splits, 64-K chunks per split) of ``config.split_k`` on a weight of ``chunks`` 64-K chunks:
    the chunks evenly over at most split_k programs, none of them empty."""
    per_split = -(-chunks // min(config.split_k, max(chunks, 1)))
    return -(-chunks // per_split), per_split


def fuses_activation(n_per_expert: int) -> bool:
    """GEMM 1 can apply the activation in the wgmma kernel: the gate and up halves of each expert's
    2I rows are whole 16-row blocks (I a multiple of 16), one register repeat each."""
    return n_per_expert % (2 * ROWS) == 0


def launch_grouped_wgmma(x2: torch.Tensor, p: MMAPackedFP4, n_per_expert: int, plan, out: torch.Tensor,
                         config: WgmmaConfig, *, gather: bool, x_mma_order: bool = False,
                         out_mma_order: bool = False, swiglu: int = 0, alpha: float = 0.0, limit: float = 0.0,
                         globals_: tuple[torch.Tensor | None, int] = (None, 0), bias: torch.Tensor | None = None,
                         row_weight: torch.Tensor | None = None, scatter: bool = False) -> torch.Tensor:
    """One launch over an MoE dispatch plan (its block_m must be ``config.block_m``): GEMM 1
    (``swiglu`` > 0: gate rows then up rows per expert, n_per_expert = 2I; writes h [R, I]) or
    GEMM 2 (routing weight ``row_weight`` per sorted row, ``scatter`` to the pair rows), with the experts' globals
    ``globals_`` = (tensor, mode) as ``ops.moe_triton._weight_globals`` and bias [E, n_per_expert].
    Activations: ``x_mma_order`` when x2 already is [R, K stored] in MMA K order (GEMM 2 reading the
    h that GEMM 1 wrote with ``out_mma_order``); otherwise one ``mma_order_rows`` pass first
    (``gather``: the plan's token rows). ``out_mma_order`` (GEMM 1) needs ``out`` [R, K stored of
    GEMM 2's weights], zero in its columns past I when I is not a multiple of 64."""
    import triton

    from ..kernels.gemm_wgmma import fp4_gemm_wgmma_kernel

    if plan.block_m != config.block_m:
        raise ValueError(f"plan: block_m {plan.block_m} differs from the configuration's {config.block_m}")
    if config.split_k > 1 or config.persistent:
        raise ValueError(f"config: the grouped GEMMs neither split K over programs nor run persistent, got {config}")
    if swiglu and config.repeats != 2:
        raise ValueError(f"config: GEMM 1 with the fused activation needs repeats=2 (a thread holds a gate row "
                         f"and its up row), got {config}")
    if p.global_scale is not None:
        raise ValueError("p: grouped weights are packed without global scales")
    if swiglu and not fuses_activation(n_per_expert):
        raise ValueError(f"n_per_expert: the fused activation needs 2I a multiple of 32, got {n_per_expert}")
    k_stored = p.words.shape[1] * KCHUNK
    R = plan.sorted_pair.shape[0]
    if x_mma_order and gather:
        raise ValueError("x_mma_order: activations already in MMA order are not gathered again (gather=False)")
    n_out = n_per_expert // 2 if swiglu else n_per_expert
    if out_mma_order:
        if not swiglu:
            raise ValueError("out_mma_order: only GEMM 1 (swiglu > 0) writes its output in MMA K order")
        width = -(-n_out // KCHUNK) * KCHUNK
        if out.dim() != 2 or out.shape[0] != R or out.shape[1] < width or out.stride(1) != 1:
            raise ValueError(f"out: GEMM 1 in MMA K order writes [{R}, {width}] (I = {n_out} padded to {KCHUNK}), "
                             f"got {tuple(out.shape)}")
    if x_mma_order:
        if tuple(x2.shape) != (R, k_stored) or x2.dtype != torch.bfloat16 or x2.stride(-1) != 1:
            raise ValueError(f"x2: expected bf16 [{R}, {k_stored}] in MMA K order, got {x2.dtype} {tuple(x2.shape)}")
        xm = x2
    else:
        xm = mma_order_rows(x2, k_stored, plan.sorted_token if gather else None)
    if R == 0:
        return out
    wg, wg_mode = globals_
    unused = plan.sorted_pair
    fp4_gemm_wgmma_kernel[(plan.max_tiles * triton.cdiv(n_out, config.block_n // 2 if swiglu else config.block_n),)](
        _w_desc(p, _w_box_rows(config, bool(swiglu))), _s_desc(p, _w_box_rows(config, bool(swiglu))),
        _x_desc(xm, config.block_m),
        _x_desc(xm, config.tail_m or config.block_m), wg if wg is not None else unused,
        bias if bias is not None else unused, out, plan.tile_expert, plan.tile_start, plan.tile_end,
        plan.sorted_pair if scatter else unused, row_weight if row_weight is not None else unused,
        R, n_per_expert, k_stored, out.stride(0),
        wg.stride(0) if wg_mode == 2 else 0, bias.stride(0) if bias is not None else 0, plan.max_tiles,
        k_stored // KCHUNK, BLOCK_M=config.block_m, STAGES=config.stages, WG_MODE=wg_mode, HAS_BIAS=bias is not None,
        SWIGLU=swiglu,
        ALPHA=alpha, LIMIT=limit, GROUPED=True, SCATTER=scatter, HAS_RW=row_weight is not None,
        OUT_MMA_ORDER=out_mma_order, GROUP_M=1, WARPS=config.warps, REPEATS=config.repeats, TAIL_M=config.tail_m,
        MERGE_TAIL=config.merge_tail, num_warps=config.warps, **_decode_consts(p.fmt, p.order), **arch_kwargs(out.device))
    return out
