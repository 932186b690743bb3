"""The mma.sync kernel on packed weights (``kernels.linear_mma``, every architecture from SM80):
its configuration (``MMAConfig``, the decode heuristic ``choose_mma_config``) and launchers, for the
plain linear (``launch_linear_mma``) and the MoE layer's grouped GEMMs over a dispatch plan
(``launch_grouped_mma``, ``launch_grouped_mma_swiglu``). Weights come packed by ``ops.mma_pack``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from ..formats import NVFP4, FP4Format
from ..target import Arch, default_gpu, get_arch
from ..tuning import current_tuning
from ._runtime import arch_kwargs, pdl_kwargs
from .mma_pack import KCHUNK, ROWS, MMAPackedFP4, _weights_before_wait

@dataclass(frozen=True)
class MMAConfig:
    """Launch parameters of ``fp4_linear_mma_kernel``: ``rb`` 16-row blocks per warp, ``warps``
    warps along N (BLOCK_N = 16 * rb * warps), ``kh`` 64-K chunks per loop step, ``block_m``
    tokens per program, ``split_k`` programs sharing one output tile along K. ``kw`` > 1: K is split
    over ``kw`` groups of ``warps`` warps inside each program instead (``fp4_linear_mma_kw_kernel``,
    plain linear only; one launch, no partial sums), and ``pdl`` launches it with programmatic
    dependent launch: 1 waits for the previous kernel before its first load, 2 requests its first
    weight step before that wait, 3 also requests the program's whole share of the weight into L2
    before it (the launcher uses 1 on a pack's first launch, see ``_launch_kw``).
    ``xs`` >= 2: x comes through a shared-memory ring of that many steps, copied by cp.async ``xs`` - 1
    steps ahead once for all the warps along N (with ``kw``, one slot per K slice), instead of each
    warp loading it into registers at the start of each step (0); the launcher keeps 0 where x's row
    stride is not a multiple of 16 elements, its start not 16-byte aligned, or K is padded.
    ``xc`` (with ``kw``): each step's x is read, decoded weights made and MMAs issued one 64-K chunk
    at a time, so x holds a chunk's registers instead of a step's (16 tokens: 16 instead of 64).
    ``xa`` (with ``xc``, x in registers): each chunk's x is requested one chunk ahead of its MMA (two
    chunks' registers), so its latency hides behind the previous chunk's decode and MMAs.
    ``pf`` > 0 (with ``kw``; ignored without bulk copies, ``Arch.has_tma``): each loop step also
    requests the weights and scales ``pf`` steps ahead into L2 (two bulk prefetches per row block),
    so that the step's own loads find them there; ``_with_x_ring`` uses it with the x ring."""

    rb: int = 1
    warps: int = 4
    kh: int = 4
    block_m: int = 16
    split_k: int = 1
    kw: int = 1
    pdl: int = 0
    xs: int = 0
    xc: bool = False
    xa: bool = False
    pf: int = 0

    def __post_init__(self) -> None:
        if self.rb not in (1, 2, 4):
            raise ValueError(f"MMAConfig.rb: expected 1, 2 or 4, got {self.rb}")
        if self.warps not in (1, 2, 4, 8):
            raise ValueError(f"MMAConfig.warps: expected 1, 2, 4 or 8, got {self.warps}")
        if self.kh not in (1, 2, 4):
            raise ValueError(f"MMAConfig.kh: expected 1, 2 or 4, got {self.kh}")
        if self.block_m not in (8, 16, 32, 64):
            raise ValueError(f"MMAConfig.block_m: expected 8, 16, 32 or 64, got {self.block_m}")
        if not 1 <= self.split_k <= 64:
            raise ValueError(f"MMAConfig.split_k: expected 1..64, got {self.split_k}")
        if self.kw not in (1, 2, 4, 8):
            raise ValueError(f"MMAConfig.kw: expected 1, 2, 4 or 8, got {self.kw}")
        if self.kw > 1 and self.split_k > 1:
            raise ValueError(f"MMAConfig: K is split inside the program (kw={self.kw}) or over programs "
                             f"(split_k={self.split_k}), not both")
        if self.warps * self.kw > 16:
            raise ValueError(f"MMAConfig: warps * kw = {self.warps * self.kw} warps per program, at most 16")
        if self.pdl not in (0, 1, 2, 3):
            raise ValueError(f"MMAConfig.pdl: expected 0, 1, 2 or 3, got {self.pdl}")
        if self.xs not in (0, 2, 3, 4):
            raise ValueError(f"MMAConfig.xs: expected 0 (x in registers) or 2..4, got {self.xs}")
        if self.pdl and self.kw == 1:
            raise ValueError("MMAConfig.pdl: only the in-program K split (kw > 1) launches with PDL")
        if self.xc and self.kw == 1:
            raise ValueError("MMAConfig.xc: x per chunk is a mode of the in-program K split (kw > 1)")
        if type(self.pf) is not int or not 0 <= self.pf <= 8:
            raise ValueError(f"MMAConfig.pf: expected 0..8 steps ahead, got {self.pf!r}")
        if self.pf and self.kw == 1:
            raise ValueError("MMAConfig.pf: weights into L2 ahead is a mode of the in-program K split (kw > 1)")
        if self.xa and not (self.xc and self.xs == 0):
            raise ValueError("MMAConfig.xa: x a chunk ahead is a mode of x per chunk in registers (xc, xs = 0)")

    @property
    def block_n(self) -> int:
        return 16 * self.rb * self.warps

    def __str__(self) -> str:
        split = f"_split{self.split_k}" if self.split_k > 1 else ""
        kw = f"_kw{self.kw}" if self.kw > 1 else ""
        pdl = ("", "_pdl", "_pdl2", "_pdl3")[self.pdl]
        xs = f"_xs{self.xs}" if self.xs else ""
        xc = "_xc" if self.xc else ""
        xc += "_xa" if self.xa else ""
        pf = f"_pf{self.pf}" if self.pf else ""
        return f"mma_n{self.block_n}_m{self.block_m}_k{64 * self.kh}_w{self.warps}{split}{kw}{pdl}{xs}{xc}{pf}"

    @classmethod
    def parse(cls, name: str) -> MMAConfig:
        """The configuration ``str`` names (benchmark and sweep records), e.g. ``mma_n16_m8_k256_w1_kw4_pdl2``."""
        m = re.fullmatch(r"mma_n(\d+)_m(\d+)_k(\d+)_w(\d+)(?:_split(\d+))?(?:_kw(\d+))?(_pdl[23]?)?(?:_xs(\d+))?(_xc)?(_xa)?(?:_pf(\d))?", name)
        if not m or int(m[1]) % (16 * int(m[4])) or int(m[3]) % 64:
            raise ValueError(f"MMAConfig.parse: not a configuration name: {name!r}")
        n, bm, k, w = (int(g) for g in m.groups()[:4])
        return cls(rb=n // (16 * w), warps=w, kh=k // 64, block_m=bm, split_k=int(m[5] or 1), kw=int(m[6] or 1),
                   pdl={None: 0, "_pdl": 1, "_pdl2": 2, "_pdl3": 3}[m[7]], xs=int(m[8] or 0),
                   xc=bool(m[9]), xa=bool(m[10]), pf=int(m[11] or 0))


#: the largest batch the MMA-layout kernel takes; wider batches use the Triton kernel (measured on the
#: H200 at M = 64: the MMA-layout kernel's x fragments spill its registers or cut its K step)
MAX_M = 16


def _fit_kh(kh: int, chunks: int) -> int:
    """The largest of kh, kh/2, ... that divides the number of 64-K chunks."""
    while chunks % kh:
        kh //= 2
    return kh


#: registers per thread of ``fp4_linear_mma_kw_kernel`` by (MXFP4, block_m, rb, kh, kw), one warp along
#: N, from ptxas for sm_90 (Triton 3.6; ``tests/test_mma_layout.py`` recompiles and compares): the
#: decode heuristic's occupancy model
KW_REGISTERS = {
    (False, 8, 1, 2, 2): 56, (False, 8, 1, 2, 4): 56, (False, 8, 1, 2, 8): 56, (False, 8, 1, 4, 2): 80,
    (False, 8, 1, 4, 4): 80, (False, 8, 1, 4, 8): 80, (False, 8, 2, 2, 2): 80, (False, 8, 2, 2, 4): 80,
    (False, 8, 2, 2, 8): 80, (False, 8, 2, 4, 2): 122, (False, 8, 2, 4, 4): 122, (False, 8, 2, 4, 8): 122,
    (False, 16, 1, 2, 2): 71, (False, 16, 1, 2, 4): 71, (False, 16, 1, 2, 8): 80, (False, 16, 1, 4, 2): 128,
    (False, 16, 1, 4, 4): 128, (False, 16, 1, 4, 8): 128, (False, 16, 2, 2, 2): 96, (False, 16, 2, 2, 4): 96,
    (False, 16, 2, 2, 8): 128, (False, 16, 2, 4, 2): 158, (False, 16, 2, 4, 4): 158, (False, 16, 2, 4, 8): 158,
    (True, 8, 1, 2, 2): 56, (True, 8, 1, 2, 4): 56, (True, 8, 1, 2, 8): 64, (True, 8, 1, 4, 2): 96,
    (True, 8, 1, 4, 4): 96, (True, 8, 1, 4, 8): 99, (True, 8, 2, 2, 2): 96, (True, 8, 2, 2, 4): 96,
    (True, 8, 2, 2, 8): 98, (True, 8, 2, 4, 2): 146, (True, 8, 2, 4, 4): 146, (True, 8, 2, 4, 8): 148,
    (True, 16, 1, 2, 2): 72, (True, 16, 1, 2, 4): 72, (True, 16, 1, 2, 8): 72, (True, 16, 1, 4, 2): 128,
    (True, 16, 1, 4, 4): 128, (True, 16, 1, 4, 8): 128, (True, 16, 2, 2, 2): 122, (True, 16, 2, 2, 4): 122,
    (True, 16, 2, 2, 8): 126, (True, 16, 2, 4, 2): 188, (True, 16, 2, 4, 4): 188, (True, 16, 2, 4, 8): 188,
}


#: ``KW_REGISTERS`` of the x-per-chunk variant (``MMAConfig.xc``), by (MXFP4, rb, kh, kw), 8-token
#: programs launched with PDL = 3 (the only ones the heuristic gives it)
KW_REGISTERS_XC = {
    (False, 1, 2, 2): 48, (False, 1, 2, 4): 48, (False, 1, 2, 8): 48, (False, 1, 4, 2): 58, (False, 1, 4, 4): 58,
    (False, 1, 4, 8): 58, (False, 2, 2, 2): 70, (False, 2, 2, 4): 70, (False, 2, 2, 8): 70, (False, 2, 4, 2): 100,
    (False, 2, 4, 4): 100, (False, 2, 4, 8): 98, (True, 1, 2, 2): 56, (True, 1, 2, 4): 56, (True, 1, 2, 8): 48,
    (True, 1, 4, 2): 66, (True, 1, 4, 4): 66, (True, 1, 4, 8): 66, (True, 2, 2, 2): 72, (True, 2, 2, 4): 72,
    (True, 2, 2, 8): 78, (True, 2, 4, 2): 128, (True, 2, 4, 4): 128, (True, 2, 4, 8): 128,
}


def choose_mma_config(M: int, N: int, K: int, sm_count: int = 132, *, fmt: FP4Format | str = NVFP4,
                      arch: Arch | str | None = None, l2_bytes: int | None = None) -> MMAConfig:
    """The decode configuration (M <= MAX_M): K split over the warps of each program
    (``MMAConfig.kw``, one launch) with PDL, chosen by an occupancy model: every program resident
    at once (one wave, from ``KW_REGISTERS``), then the most weight bytes in flight per SM up to
    ``LinearTuning.decode_inflight_bytes`` (one loop step per warp is in flight while the previous
    one decodes), then (ties) longer steps, then more resident warps (the other way round for
    8-token programs of large weights, ``LinearTuning.warps_first_blocks_per_sm``). Each warp runs at
    least 2 loop steps (4 for 16-token programs, whose x fragments cost more per step). 8 tokens per
    program at M <= 8, 16 above. Occupancy limits and PDL from the catalogue entry of ``arch``
    (default SM90, where the model was fitted). Weights of at most ``LinearTuning.pdl_l2_share`` of
    the L2 (``l2_bytes``; default that of the catalogue's first GPU of ``arch``) are requested into
    L2 whole before the PDL wait (``pdl`` = 3); there, 8-token programs first look for a grid that
    fits on the SMs twice (``LinearTuning.pdl3_coresident``), with x read per chunk
    (``MMAConfig.xc``, fewer registers) where only that fits."""
    from ..formats import get_format

    arch = get_arch(arch or "sm90")
    tune = current_tuning().linear
    mx = get_format(fmt) is not NVFP4
    block_m = 8 if M <= 8 else 16
    chunks = -(-K // KCHUNK)
    min_steps = 2 if block_m == 8 else 4
    weight_bytes = -(-N // ROWS) * chunks * (KCHUNK * ROWS // 2) * (1 + (1 / 16 if mx else 1 / 8))  # words, scales
    l2 = l2_bytes or int(default_gpu(arch).l2_mib * 2**20)
    pdl3 = arch.has_pdl and weight_bytes <= tune.pdl_l2_share * l2
    coresident = coresident_rule(mx, block_m, pdl3)
    # ties on bytes in flight: more resident warps before longer steps for 8-token programs of a
    # weight streamed from DRAM with at least warps_first_blocks_per_sm row blocks per SM
    warps_first = block_m == 8 and not pdl3 and -(-N // ROWS) >= tune.warps_first_blocks_per_sm * sm_count
    best, best_score = None, None
    for rb in (1, 2):
        for kh in (2, 4):
            for kw in (2, 4, 8):
                if chunks % (kh * kw) or chunks // (kh * kw) < min_steps:
                    continue
                for xc in (False, True) if coresident else (False,):
                    regs = KW_REGISTERS_XC[(mx, rb, kh, kw)] if xc else KW_REGISTERS[(mx, block_m, rb, kh, kw)]
                    per_sm = arch.ctas_per_sm(32 * kw, registers=regs,
                                              smem_bytes=kw * 16 * rb * block_m * 4)  # the partial tiles
                    programs = -(-N // (16 * rb)) * -(-M // block_m)
                    resident = min(programs / sm_count, per_sm)
                    inflight = min(resident * kw * rb * kh * 512, tune.decode_inflight_bytes)
                    # the next launch's programs fit beside this one's (each SM's share twice)
                    twice = not coresident or 2 * -(-programs // sm_count) <= per_sm
                    ties = (resident * kw, kh) if warps_first else (kh, resident * kw)
                    score = (programs <= per_sm * sm_count, twice, inflight, *ties, not xc)
                    if best_score is None or score > best_score:
                        best, best_score = MMAConfig(rb=rb, warps=1, kh=kh, block_m=block_m, kw=kw,
                                                     pdl=(3 if pdl3 else 2) if arch.has_pdl else 0, xc=xc), score
    if best is None:  # K too short to split over warps: one warp per program, K in one slice
        kh = _fit_kh(4, chunks)
        return MMAConfig(rb=1, warps=4, kh=kh, block_m=block_m, split_k=1)
    return _with_x_ring(best, M, N, chunks, sm_count, mx, arch)


def coresident_rule(mx: bool, block_m: int, pdl3: bool) -> bool:
    """Whether ``choose_mma_config`` ranks grids that fit each SM twice and considers x per chunk
    (``LinearTuning.pdl3_coresident``, ``pdl3_coresident_mxfp4``) for programs of ``block_m`` tokens."""
    tune = current_tuning().linear
    return pdl3 and block_m == 8 and tune.pdl3_coresident and (not mx or tune.pdl3_coresident_mxfp4)


def _with_x_ring(c: MMAConfig, M: int, N: int, chunks: int, sm_count: int, mx: bool, arch: Arch) -> MMAConfig:
    """``c`` with ``xs`` = 2 (x through the shared-memory ring) for 16-token programs of one 16-row
    block (their x step is 4x their weight step) whose K slices run at least
    ``LinearTuning.x_ring_min_steps`` steps and whose grid stays one wave with the ring's shared
    memory; elsewhere (a second wave, 8-token programs, the MoE GEMMs) it stays off
    (docs/performance-engineering.md, ``LinearTuning.x_ring_min_steps``). With the ring, on GPUs
    with bulk copies, the weights also go into L2 ``LinearTuning.x_ring_prefetch_steps`` steps ahead
    (``MMAConfig.pf``)."""
    tune = current_tuning().linear
    if c.block_m != 16 or c.rb != 1 or c.warps != 1 or chunks // (c.kh * c.kw) < tune.x_ring_min_steps:
        return c
    ring = 2 * c.kw * c.block_m * c.kh * KCHUNK * 2
    # the partial tiles' scratch comes after the loop and reuses the ring's memory
    per_sm = arch.ctas_per_sm(32 * c.kw, registers=KW_REGISTERS[(mx, c.block_m, c.rb, c.kh, c.kw)],
                              smem_bytes=max(ring, c.kw * 16 * c.block_m * 4))
    if -(-N // c.block_n) * -(-M // c.block_m) > per_sm * sm_count:
        return c
    return replace(c, xs=2, pf=tune.x_ring_prefetch_steps if arch.has_tma else 0)


def _split(config: MMAConfig, chunks: int) -> tuple[int, int, int]:
    """(kh, splits, 64-K chunks per split) for ``config`` on a weight of ``chunks`` 64-K chunks."""
    kh = _fit_kh(config.kh, chunks)
    steps = chunks // kh
    split = min(config.split_k, steps)
    per_split = -(-steps // split) * kh
    return kh, -(-chunks // per_split), per_split


def _fit_kw(config: MMAConfig, chunks: int) -> tuple[int, int]:
    """(kh, kw) for ``config`` on a weight of ``chunks`` 64-K chunks: every K slice the same whole
    number of steps (kw halved first, then kh)."""
    kh, kw = _fit_kh(config.kh, chunks), config.kw
    while chunks % (kh * kw):
        if kw > 1:
            kw //= 2
        else:
            kh //= 2
    return kh, kw


def _launch_kw(x2, p: MMAPackedFP4, bias, out, config: MMAConfig):
    """The one launch of ``fp4_linear_mma_kw_kernel`` (``config.kw`` > 1): out = x2 @ W^T (+ bias)."""
    import triton

    from ..kernels.linear_mma import (FOLD_E4M3, FOLD_E8M0, decode_asm, fp4_linear_mma_kw_kernel, scale_asm,
                                      x_layout_kw)
    from ._runtime import device_arch

    if x2.dtype != torch.bfloat16:
        raise TypeError(f"x: the MMA-layout kernel takes bfloat16 activations, got {x2.dtype}")
    M, N = x2.shape[0], p.shape[0]
    chunks = p.words.shape[1]
    kh, kw = _fit_kw(config, chunks)
    mx = p.fmt is not NVFP4
    unused = p.scales
    arch = device_arch(p.words.device)
    has_pdl = arch is not None and arch.has_pdl  # griddepcontrol
    pdl = _weights_before_wait(p, config.pdl if has_pdl else 0)  # without it: an ordinary launch
    fp4_linear_mma_kw_kernel[(triton.cdiv(N, config.block_n), triton.cdiv(M, config.block_m))](
        p.words, p.scales.view(torch.int16), x2, p.global_scale if p.global_scale is not None else unused,
        bias if bias is not None else unused, out, M, N, chunks * KCHUNK, x2.shape[1], x2.stride(0), out.stride(0),
        chunks // kw, RB=config.rb, WARPS=config.warps, KW=kw, KH=kh, BLOCK_M=config.block_m, MXFP4=mx,
        HAS_WG=p.global_scale is not None, HAS_BIAS=bias is not None, FOLD=FOLD_E8M0 if mx else FOLD_E4M3,
        DECODE=decode_asm(p.order), SCALE=scale_asm(mx),
        X_LAYOUT=x_layout_kw(config.block_m, 1 if config.xc else kh, config.warps, kw), XC=config.xc,
        XA=config.xa, EVEN_K=chunks * KCHUNK == x2.shape[1], PDL=pdl, X_STAGES=_x_stages(config, x2, chunks),
        PF=config.pf if arch is not None and arch.has_tma else 0,  # cp.async.bulk.prefetch.L2: bulk-copy GPUs
        num_warps=config.warps * kw, launch_pdl=pdl > 0, **arch_kwargs(x2.device))
    return out


def _x_stages(config: MMAConfig, x2: torch.Tensor, chunks: int) -> int:
    """``config.xs``, or 0 (x in registers) where the ring's 16-byte copies of whole K steps cannot
    read x: K padded to the 64-K chunk, or a row stride the compiler cannot prove 16-byte aligned
    (Triton specialises an integer argument only as a multiple of 16: a stride of 8 mod 16 elements
    would compile to 2-byte copies, which cp.async does not have), or an unaligned start."""
    even_k = chunks * KCHUNK == x2.shape[1]
    return config.xs if even_k and x2.stride(0) % 16 == 0 and x2.data_ptr() % 16 == 0 else 0


def _launch(x2, p: MMAPackedFP4, bias, target, M: int, N: int, config: MMAConfig, grid_m: int, *, plan=None,
            gather: bool = False, stride_ym: int = 0, swiglu: bool = False, globals_=(None, 0),
            plan_ready: bool = False, independent: bool = False):
    """The one launch of ``fp4_linear_mma_kernel`` (plain, or GROUPED over an MoE plan's tiles;
    ``swiglu``: MoE GEMM 1 with its epilogue, N outputs, ``globals_`` as ``ops.moe_triton._weight_globals``,
    ``bias`` [E, 2N] or None; ``plan_ready`` and ``independent`` as ``launch_grouped_mma``'s)."""
    import triton

    from ..kernels.linear_mma import FOLD_E4M3, FOLD_E8M0, decode_asm, fp4_linear_mma_kernel, scale_asm, x_layout

    if x2.dtype != torch.bfloat16:
        raise TypeError(f"x: the MMA-layout kernel takes bfloat16 activations, got {x2.dtype}")
    chunks = p.words.shape[1]
    kh, split, per_split = _split(config, chunks)
    mx = p.fmt is not NVFP4
    unused = p.scales  # pointer arguments a variant does not read (Triton needs a tensor)
    tiles = (plan.tile_expert, plan.tile_start, plan.tile_end) if plan is not None else (unused,) * 3
    # the MoE chain (dispatch -> GEMM -> epilogue) launches with PDL; the plain linear's split-K path does not
    pdl = pdl_kwargs(x2.device) if plan is not None else {"PDL": 0, "launch_pdl": False}
    x_stages = _x_stages(config, x2, chunks)
    if independent and pdl["PDL"] and x_stages:  # x in registers is loaded through L1: wait for it
        pdl = {"PDL": 3, "launch_pdl": True}
    elif plan_ready and pdl["PDL"]:
        pdl = {"PDL": 2, "launch_pdl": True}
    wg, wg_mode = globals_
    if wg is None:
        wg = p.global_scale
    fp4_linear_mma_kernel[(triton.cdiv(N, config.block_n), grid_m, split)](
        p.words, p.scales.view(torch.int16), x2, wg if wg is not None else unused,
        bias if bias is not None else unused, target, *tiles, plan.sorted_token if gather else unused,
        M, N, chunks * KCHUNK, x2.shape[1], x2.stride(0), stride_ym, per_split,
        wg.stride(0) if wg_mode == 2 else 0, bias.stride(0) if swiglu and bias is not None else 0,
        RB=config.rb, WARPS=config.warps, KH=kh, BLOCK_M=config.block_m, MXFP4=mx,
        HAS_WG=p.global_scale is not None, HAS_BIAS=bias is not None, SPLIT_K=split,
        FOLD=FOLD_E8M0 if mx else FOLD_E4M3, DECODE=decode_asm(p.order), SCALE=scale_asm(mx),
        X_LAYOUT=x_layout(config.block_m, kh, config.warps), EVEN_K=chunks * KCHUNK == x2.shape[1],
        GROUPED=plan is not None, GATHER=gather, SWIGLU=swiglu, WG_MODE=wg_mode,
        X_STAGES=x_stages,
        num_warps=config.warps, **pdl, **arch_kwargs(x2.device))
    return split


def launch_linear_mma(x2: torch.Tensor, p: MMAPackedFP4, bias: torch.Tensor | None, out: torch.Tensor,
                      config: MMAConfig) -> torch.Tensor:
    """One launch: ``out[M, N] = x2[M, K] @ W^T (+ bias)``; x2 bf16 with unit stride along K,
    out with unit stride along N. Compiled CUDA only (Gluon; no interpreter)."""
    import triton


    if config.kw > 1:
        return _launch_kw(x2, p, bias, out, config)
    M = x2.shape[0]
    N = p.shape[0]
    split = _split(config, p.words.shape[1])[1]
    target = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=out.device)
    _launch(x2, p, bias, target, M, N, config, triton.cdiv(M, config.block_m), stride_ym=out.stride(0))
    if split > 1:
        from .split_k import reduce_splits

        reduce_splits(target, bias, out)
    return out


def _check_grouped(p: MMAPackedFP4, plan, config: MMAConfig) -> None:
    """What both grouped launches need: the plan made for the configuration's tile height, and the
    experts packed without global scales (the MoE epilogues apply them)."""
    if plan.block_m != config.block_m:
        raise ValueError(f"plan: block_m {plan.block_m} differs from the configuration's {config.block_m}")
    if p.global_scale is not None:
        raise ValueError("p: grouped weights are packed without global scales")


def launch_grouped_mma(x2: torch.Tensor, p: MMAPackedFP4, n_per_expert: int, plan, config: MMAConfig, *,
                       gather: bool, plan_ready: bool = False, out: torch.Tensor | None = None,
                       independent: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Partial sums ``part[s, r, :] = W_e @ x[row(r)]`` over the K share of split s, for every sorted
    row r of an MoE dispatch plan (``ops.dispatch``; its block_m must be ``config.block_m``) that
    one of the plan's tiles covers, e the row's expert. ``p`` packs the experts' weights stacked
    [E * n_per_expert, K] without global scales (the MoE epilogue applies them). Returns part
    [splits, R, n_per_expert] in ``dtype`` (fp32, or bf16: each row's sum rounded once; ``out`` when
    given: a second launch over another class of the plan's experts, ``ops.dispatch.tile_map(rows=...)``,
    writes its rows into the same tensor).
    ``plan_ready``: the plan was written at least two kernels before this one in the PDL chain (MoE
    GEMM 2), so with PDL the kernel reads it and requests its first weight step before it waits for
    the previous kernel (whose launch already waited for the plan's writer to complete).
    ``independent``: nothing this launch reads was written by the kernel before it in the PDL chain,
    and none of its rows either (the second class of ``ops.moe.MMAHeights``, after the first): with
    PDL it runs alongside that kernel's last programs instead of waiting for it, and its last program
    waits for it, so that the next kernel's wait covers both. Only with x through the shared-memory
    ring (``MMAConfig.xs``, where ``_x_stages`` keeps it): x in registers is read through L1, which
    a grid that has not waited may hold stale; elsewhere the launch waits as usual."""
    _check_grouped(p, plan, config)
    if config.kw > 1:
        raise ValueError(f"config.kw: the grouped kernel splits K over programs (split_k), got kw={config.kw}")
    R = plan.sorted_pair.shape[0]
    split = _split(config, p.words.shape[1])[1]
    shape = (split, R, n_per_expert)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype: the partial sums are float32 or bfloat16, got {dtype}")
    if out is None:
        part = torch.empty(shape, dtype=dtype, device=x2.device)
    elif out.shape != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous {dtype} {shape}, got {out.dtype} {tuple(out.shape)}")
    else:
        part = out
    if plan.max_tiles == 0:  # a class of experts that no batch of this size can fill
        return part
    _launch(x2, p, None, part, R, n_per_expert, config, plan.max_tiles, plan=plan, gather=gather,
            plan_ready=plan_ready, independent=independent)
    return part


def launch_grouped_mma_swiglu(x2: torch.Tensor, p: MMAPackedFP4, n_out: int, plan, config: MMAConfig,
                              out: torch.Tensor, globals_, bias: torch.Tensor | None,
                              independent: bool = False) -> torch.Tensor:
    """MoE GEMM 1 with its epilogue in the kernel: ``out[r, :] = silu(g) * u`` (bf16) for every
    sorted row r of the plan, where g and u are the row's token times the expert's gate rows [0,
    n_out) and up rows [n_out, 2 n_out), with ``globals_`` (``ops.moe_triton._weight_globals``) and
    ``bias`` [E, 2 n_out] applied as ``moe_partials_epilogue_kernel`` does. ``p`` packs the
    experts' [E * 2 n_out, K] rows without global scales; n_out a multiple of 16; no K split. Rows
    no tile of the plan covers are not written (a class of experts, ``ops.dispatch.tile_map``);
    ``independent`` as ``launch_grouped_mma``'s."""
    _check_grouped(p, plan, config)
    if config.kw > 1 or config.split_k > 1:
        raise ValueError(f"config: the fused SwiGLU epilogue needs whole K per program, got {config}")
    if n_out % ROWS:
        raise ValueError(f"n_out: the up rows start a whole 16-row block after the gate rows, got {n_out}")
    if plan.max_tiles:
        _launch(x2, p, bias, out, plan.sorted_pair.shape[0], n_out, config, plan.max_tiles, plan=plan, gather=True,
                stride_ym=out.stride(0), swiglu=True, globals_=globals_, independent=independent)
    return out
