"""The MoE experts on weights in MMA operand order (``ops.mma_pack``): the grouped mma.sync decode
path (``ops.mma_sync``; one configuration, or ``MMAHeights``: two tile heights per GEMM) and the
wgmma prefill path on SM90 (``ops.wgmma``), their configurations and the launches of one layer.
Choices come from ``MoETuning`` (``fp4moe.tuning``). ``ops.moe`` is the public API.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from ..kernels.moe import GPT_OSS_ALPHA, GPT_OSS_LIMIT  # gpt-oss's activation constants (one definition)
from ..quantize import FP4Tensor
from ..tuning import current_tuning
from ._runtime import interpreting
from .dispatch import dispatch, tile_map
from .moe_triton import (_SWIGLU, _pair_weights, _weight_globals, launch_combine, launch_partials_combine,
                         launch_partials_epilogue)


def packed_layout_config(x: torch.Tensor, w13: FP4Tensor, w2: FP4Tensor, mode: str, arch, rows_per_expert: float,
                         interleaved: bool):
    """The configuration of the kernels on weights in MMA operand order (``ops.mma_pack``), or None
    for ``moe_gemm_kernel``: on compiled CUDA, W4A16 with bf16 activations, or emulated W4A4 (no FP4
    MMA; ``_w4a4_activations``) with bf16 or fp16 activations; the kernel from ``packed_moe_kernel`` (an
    ``MMAConfig`` for the mma.sync kernel, a ``WgmmaConfig`` for the wgmma kernel with the activation
    fused into GEMM 1)."""
    from .linear import runs_packed

    if not (x.is_cuda and not interpreting() and arch is not None and runs_packed(mode, arch)):
        return None
    if mode == "w4a16" and x.dtype != torch.bfloat16:
        return None
    kernel = packed_moe_kernel(arch, rows_per_expert, w13.shape[1], w2.shape[1], interleaved)
    if kernel == "mma":
        return mma_moe_layer_config(rows_per_expert, w13.shape[0])
    if kernel == "wgmma":
        return wgmma_moe_config(rows_per_expert)
    return None


def packed_moe_kernel(arch, rows_per_expert: float, n13: int, n2: int, interleaved: bool) -> str | None:
    """Which kernel on weights in MMA operand order runs a bf16 W4A16 layer (w13 [E, n13, H],
    w2 [E, n2, I]): "mma" (grouped mma.sync, every architecture from SM80) up to MAX_M rows per
    expert, or up to ``MoETuning.wgmma_min_rows`` where the wgmma kernel can take over; "wgmma" (SM90, w13
    gate-then-up with I a multiple of 16) above; None for the Triton kernels (weight rows not whole
    16-row blocks, or larger layers elsewhere)."""
    from .mma_pack import ROWS
    from .mma_sync import MAX_M
    from .wgmma import fuses_activation

    if n13 % ROWS or n2 % ROWS:
        return None
    wgmma = arch.bf16_mma == "wgmma" and not interleaved and fuses_activation(n13)
    if rows_per_expert <= (current_tuning().moe.wgmma_min_rows if wgmma else MAX_M):
        return "mma"
    return "wgmma" if wgmma else None


def mma_packed_experts(w: FP4Tensor):
    """Stacked expert weights [E, N, K] packed as one [E * N, K] weight in MMA operand order (bit
    order ``MoETuning.word_order``, read when the pack is made), without global scales (the MoE epilogue applies them per expert or
    per row); kept with the weight's storage like ``ops.linear.mma_packed`` (and packed again after
    its bytes or scales changed in place). None while a CUDA graph is captured and no current pack
    exists."""
    from .mma_pack import cached_pack, pack_mma

    def make(w: FP4Tensor):
        E, N, K = w.shape
        ones = torch.ones(1, dtype=torch.float32, device=w.device) if w.global_scale is not None else None
        flat = FP4Tensor(w.data.reshape(E * N, K // 2), w.scales.reshape(E * N, -1), ones, torch.Size((E * N, K)),
                         w.fmt)
        return replace(pack_mma(flat, current_tuning().moe.word_order), global_scale=None)

    return cached_pack(w, make, with_global=False)


@dataclass(frozen=True)
class MMAHeights:
    """The decode path's grouped mma.sync GEMMs as two launches each over one dispatch plan (made
    for ``large.block_m``): the experts with at most ``rows`` rows on ``small``, the others on
    ``large`` (``ops.dispatch.tile_map(rows=...)`` gives each launch its class's tiles; no host
    synchronisation). Both write into the same h and partial sums; the epilogues and the combine
    run once. Every output row comes from one launch, so the result equals either configuration's
    alone bit for bit where their K steps add in the same order."""

    small: object  # MMAConfig
    large: object  # MMAConfig
    rows: int

    def __post_init__(self) -> None:
        from .mma_sync import MMAConfig

        if not (isinstance(self.small, MMAConfig) and isinstance(self.large, MMAConfig)):
            raise TypeError(f"MMAHeights: expected two MMAConfig, got {type(self.small).__name__}, "
                            f"{type(self.large).__name__}")
        if isinstance(self.rows, bool) or not isinstance(self.rows, int) or self.rows < 1:
            raise ValueError(f"MMAHeights.rows: expected a positive int, got {self.rows!r}")
        if not self.small.block_m < self.large.block_m:
            raise ValueError(f"MMAHeights: small tiles ({self.small.block_m} rows) must be shorter than large "
                             f"ones ({self.large.block_m})")
        if self.small.split_k != self.large.split_k or self.small.kw != 1 or self.large.kw != 1:
            raise ValueError("MMAHeights: both launches write one partial-sum tensor (the same split_k, kw = 1), "
                             f"got {self.small} and {self.large}")

    @property
    def block_m(self) -> int:
        """The dispatch plan's tile height (the large class's)."""
        return self.large.block_m

    @property
    def split_k(self) -> int:
        return self.large.split_k

    def classes(self):
        """(configuration, (lo, hi) rows of its experts) per launch, the short tiles first."""
        from .dispatch import ALL_ROWS

        return ((self.small, (0, self.rows)), (self.large, (self.rows, ALL_ROWS)))

    def __str__(self) -> str:
        return f"{self.small}+{self.large}@{self.rows}"


def mma_moe_layer_config(rows_per_expert: float, n_experts: int | None = None):
    """The decode path's configuration: ``mma_moe_config``'s, or where its tiles are taller than
    8 rows and experts average at most ``MoETuning.heights_rows``, an ``MMAHeights`` of the 8-row
    configuration for the experts of at most 8 rows and that one, with x through a shared-memory
    ring of ``MoETuning.heights_x_stages`` steps, for the others. ``n_experts`` (the layer's E) lets
    ``mma_moe_config`` see the token-expert pairs (its few-pairs configurations)."""
    tune = current_tuning().moe
    cfg = mma_moe_config(rows_per_expert, n_experts)
    small = mma_moe_config(1)
    if cfg.block_m > small.block_m and rows_per_expert <= tune.heights_rows:
        return MMAHeights(small, replace(cfg, xs=tune.heights_x_stages), small.block_m)
    return cfg


def mma_moe_config(rows_per_expert: float, n_experts: int | None = None):
    """The grouped GEMMs' configuration (GEMM 2 takes ``mma_moe_gemm2_config`` of it), no K split
    (the active experts' row blocks fill the GPU): tiles of 8 rows, 64 weight rows and 256 K per
    step; past 4 rows per expert 16-row tiles of 128 weight rows and 128 K per step (two row blocks
    per warp share each x fragment; docs/performance-engineering.md, ``mma_moe_config``).

    With ``n_experts``, few pairs (``MoETuning.few_pairs``: at most the first many, then the second)
    get more, smaller programs: with the experts' words in the rotation order the 4-warp 256-K tiles
    wait on their weights there (docs/performance-engineering.md, ``MoETuning.few_pairs``)."""
    from .mma_sync import MMAConfig

    few = current_tuning().moe.few_pairs
    if n_experts is not None and rows_per_expert * n_experts <= few[0]:
        return _few_pairs_split()
    if n_experts is not None and rows_per_expert * n_experts <= few[1]:
        return MMAConfig(rb=1, warps=2, kh=4, block_m=8, split_k=1)
    if rows_per_expert <= 4:
        return MMAConfig(rb=1, warps=4, kh=4, block_m=8, split_k=1)
    return MMAConfig(rb=2, warps=4, kh=2, block_m=16, split_k=1)


def _few_pairs_split():
    """``mma_moe_config``'s configuration for at most ``MoETuning.few_pairs[0]`` pairs: K split in
    ``MoETuning.few_pairs_split``, 128-K steps."""
    from .mma_sync import MMAConfig

    return MMAConfig(rb=1, warps=4, kh=2, block_m=8, split_k=current_tuning().moe.few_pairs_split)


def mma_moe_gemm2_config(cfg, rows: tuple[int, int] | None = None):
    """GEMM 2's configuration on the decode path where the layer's (``mma_moe_layer_config``, GEMM
    1's) is ``cfg``, or, with ``rows``, that of the ``MMAHeights`` class of those rows.

    The short-tile class of ``MMAHeights`` (rows (0, h]) takes ``MoETuning.heights_gemm2_small_rb``
    row blocks per warp: 128 weight rows per program, so each program's 8 rows of h are read for
    twice the weights. Otherwise the same as ``cfg``, except that the few-pairs split takes
    ``MoETuning.few_pairs_gemm2`` (row blocks per warp, K split) in GEMM 2 (rows add their K steps in
    the same order, so the output is bitwise the same; docs/performance-engineering.md,
    ``MoETuning.few_pairs_gemm2``)."""
    tune = current_tuning().moe
    if cfg == _few_pairs_split():
        return replace(cfg, rb=tune.few_pairs_gemm2[0], split_k=tune.few_pairs_gemm2[1])
    if rows is not None and rows[0] == 0:
        return replace(cfg, rb=tune.heights_gemm2_small_rb)
    return cfg


def wgmma_moe_config(rows_per_expert: float):
    """Above ``MoETuning.wgmma_min_rows`` rows per expert on SM90: one warpgroup of two register
    repeats per program, 32-row tiles while experts average <= 24 rows, 64-row tiles up to 48 rows,
    else 128-row tiles whose short tails (<= 32 rows) run with 32-row wgmmas in both GEMMs
    (``tail_m``, ``MoETuning.gemm2_tails``; docs/performance-engineering.md, ``wgmma_moe_config``).

    Merged tails (``WgmmaConfig.merge_tail``) where experts average one full tile to one full tile
    plus a tail (``MoETuning.merge_tail_rows``): most experts then have a full tile and a short one,
    whose weights the merged tile decodes once."""
    from .wgmma import WgmmaConfig

    if rows_per_expert <= 24:
        return WgmmaConfig(block_m=32, stages=4, warps=4)
    if rows_per_expert <= 48:
        return WgmmaConfig(block_m=64, stages=4, warps=4)
    lo, hi = current_tuning().moe.merge_tail_rows
    return WgmmaConfig(block_m=128, stages=4, warps=4, tail_m=32, merge_tail=lo <= rows_per_expert <= hi)


def fuses_swiglu(cfg, activation: str, interleaved: bool, I: int, programs_per_sm: float) -> bool:
    """Whether the decode path's GEMM 1 writes h itself (``MoETuning.fused_swiglu``): SiLU, gate rows
    then up rows, I a whole number of 16-row blocks, K not split over programs, and a grid of at
    least ``MoETuning.fused_swiglu_min_programs_per_sm`` (``programs_per_sm``: the plan's worst-case
    tiles times the output blocks, over the SMs)."""
    from .mma_pack import ROWS

    tune = current_tuning().moe
    return (tune.fused_swiglu and activation == "silu" and not interleaved and I % ROWS == 0 and cfg.split_k == 1
            and cfg.kw == 1 and programs_per_sm >= tune.fused_swiglu_min_programs_per_sm)


def fused_programs_per_sm(tiles: int, I: int, cfg, sm_count: int) -> float:
    """Programs per SM of the fused GEMM 1's grid of ``tiles`` plan tiles (``fuses_swiglu``)."""
    return tiles * -(-I // cfg.block_n) / sm_count


def decode_fuses_swiglu(cfg, activation: str, interleaved: bool, I: int, tiles: int, device) -> bool:
    """``fuses_swiglu`` for a plan of ``tiles`` tiles (its worst case, ``max_tiles``) on ``device``
    (``MMAHeights``: the large class's configuration decides for both launches)."""
    if isinstance(cfg, MMAHeights):
        cfg = cfg.large
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return fuses_swiglu(cfg, activation, interleaved, I, fused_programs_per_sm(tiles, I, cfg, sm_count))


def overlaps_previous_class(rows) -> bool:
    """Whether the launch of ``MMAHeights``' class of experts with lo < rows <= hi (``rows``; None:
    one launch for all) runs alongside the class launch before it (``MoETuning.heights_overlap``,
    ``launch_grouped_mma(independent=True)``): every class but the first, whose rows neither it reads
    nor writes. The runtime's rule (``_overlaps``) and the planner's compile requests."""
    return current_tuning().moe.heights_overlap and rows is not None and rows[0] > 0


def _overlaps(launches, i: int) -> bool:
    """``overlaps_previous_class`` for launch ``i`` of a GEMM's (configuration, plan, rows) launches,
    only where the launches before it run: a class whose plan holds no tiles launches nothing, and
    the next would then follow the kernel that wrote its inputs."""
    return overlaps_previous_class(launches[i][2]) and all(pl.max_tiles > 0 for _, pl, _ in launches[:i])


def mma_pair_rows(cfg2, chunks: int, out_dtype: str) -> str:
    """The dtype ("bf16" or "fp32") of GEMM 2's partial sums on the decode path for its
    configuration ``cfg2`` on weights of ``chunks`` 64-K chunks and a layer output of ``out_dtype``
    ("bf16" or "fp16"): ``MoETuning.pair_rows`` for bf16 outputs, fp32 for fp16 ones (3 more bits than a
    bf16 row keeps) and wherever K is split (each split's sum would be rounded)."""
    from .mma_sync import _split

    bf16 = current_tuning().moe.pair_rows == "bf16" and out_dtype == "bf16" and _split(cfg2, chunks)[1] == 1
    return "bf16" if bf16 else "fp32"


def _run_mma(x, w13, w2, packed, topk_ids, topk_weights, plan, cfg, k, activation, interleaved, w13_bias, w2_bias,
             shared_out, out, fused=None, requant=None):
    """GEMM 1 with its epilogue (globals, bias, SwiGLU) in the kernel (``fuses_swiglu``), else GEMM 1
    partials -> epilogue kernel; GEMM 2 partials -> its epilogue (globals, bias, routing weight) and
    the combine in one kernel; ``cfg`` (an ``MMAConfig``, or ``MMAHeights``: two launches per GEMM)
    for GEMM 1 and, through ``mma_moe_gemm2_config``, GEMM 2, the plan made for ``cfg.block_m``;
    the second class launch of each GEMM overlaps the first (``_overlaps``); ``fused`` (None:
    ``decode_fuses_swiglu``) pins GEMM 1's variant. ``requant``
    (emulated W4A4, ``_w4a4_activations``): h -> (GEMM 2's bf16 input, w2 with its global scales) between
    the GEMMs; h (in ``out``'s dtype, x's) is then zero in the rows of dropped slots."""
    from .mma_sync import launch_grouped_mma, launch_grouped_mma_swiglu

    T, H = x.shape
    I = w2.shape[2]
    p13, p2 = packed
    h = (torch.zeros if requant else torch.empty)((T * k, I), dtype=out.dtype, device=x.device)
    if fused is None:
        fused = decode_fuses_swiglu(cfg, activation, interleaved, I, plan.max_tiles, x.device)
    if isinstance(cfg, MMAHeights):  # each class's tiles over the same plan (both maps before the GEMMs)
        maps = plan.class_tiles  # ``packed_dispatch``'s; a plan made without them gets a launch per class
        if [(t.block_m, t.rows) for t in maps] != [(c.block_m, rows) for c, rows in cfg.classes()]:
            maps = [tile_map(plan, c.block_m, rows) for c, rows in cfg.classes()]
        launches = [(c, replace(plan, tiles=t), rows) for (c, rows), t in zip(cfg.classes(), maps)]
    else:
        launches = [(cfg, plan, None)]
    part = None
    globals13 = _weight_globals(w13) if fused else None  # once, before the launches (any copy it makes too)
    for i, (c, pl, _) in enumerate(launches):
        ind = _overlaps(launches, i)
        if fused:
            launch_grouped_mma_swiglu(x, p13, I, pl, c, h, globals13, w13_bias, independent=ind)
        else:
            part = launch_grouped_mma(x, p13, 2 * I, pl, c, gather=True, out=part, independent=ind)
    if not fused:
        launch_partials_epilogue(part, w13, plan, h, swiglu=_SWIGLU[activation], interleaved=interleaved,
                                 scatter=False, row_weight=None, bias=w13_bias)
    if requant:
        h, w2 = requant(h)
    # GEMM 2 follows GEMM 1 (and, unfused, the epilogue): dispatch wrote the plan two or more kernels back
    part = None
    pair_rows = mma_pair_rows(mma_moe_gemm2_config(launches[0][0]), p2.words.shape[1],
                              "bf16" if out.dtype == torch.bfloat16 else "fp16")
    dtype = torch.bfloat16 if pair_rows == "bf16" else torch.float32
    for i, (c, pl, rows) in enumerate(launches):
        part = launch_grouped_mma(h, p2, H, pl, mma_moe_gemm2_config(c, rows), gather=False, plan_ready=True, out=part,
                                  independent=_overlaps(launches, i), dtype=dtype)
    return launch_partials_combine(part, w2, plan, topk_ids, _pair_weights(topk_weights), shared_out, w2_bias, out)


#: GEMM 2's per-pair output rows on the wgmma path (prefill), which the combine reads back: bf16
#: (each expert's weighted output rounded once before the fp32 sum in slot order) halves the
#: traffic of fp32 rows, 805 MB of them at 4096 GLM-5 tokens.
PAIR_ROWS_DTYPE = torch.bfloat16


def wgmma_gemm2_config(cfg):
    """GEMM 2's configuration on the plan GEMM 1's ``cfg`` was chosen for (``MoETuning.gemm2_tails``)."""
    return cfg if current_tuning().moe.gemm2_tails else cfg.with_tail(0)


def _run_wgmma(x, w13, w2, packed, topk_ids, topk_weights, plan, cfg, k, activation, w13_bias, w2_bias, shared_out,
               out, requant=None):
    """GEMM 1 with the activation fused (writes h) -> GEMM 2 with the routing weight, scattered to
    pair rows -> combine; ``cfg`` GEMM 1's ``WgmmaConfig`` (GEMM 2's: ``wgmma_gemm2_config``), the
    plan made for its block_m. ``requant`` as ``_run_mma``'s: h is then written in K order (the
    quantizer's blocks are 16 consecutive K) and ``requant`` returns it in GEMM 2's MMA K order."""
    from .mma_pack import KCHUNK
    from .wgmma import launch_grouped_wgmma

    T, H = x.shape
    I = w2.shape[2]
    p13, p2 = packed
    # h in GEMM 2's MMA K order (its columns past I, if any, stay zero): GEMM 2's TMA reads it as it is
    i_stored = p2.words.shape[1] * KCHUNK
    if requant:
        h = torch.zeros((T * k, I), dtype=out.dtype, device=x.device)
    else:
        h = (torch.empty if i_stored == I else torch.zeros)((T * k, i_stored), dtype=x.dtype, device=x.device)
    alpha, limit = GPT_OSS_ALPHA, GPT_OSS_LIMIT
    launch_grouped_wgmma(x, p13, 2 * I, plan, h, cfg, gather=True, out_mma_order=not requant,
                         swiglu=_SWIGLU[activation], alpha=alpha, limit=limit, globals_=_weight_globals(w13),
                         bias=w13_bias)
    if requant:
        h, w2 = requant(h, k_stored=i_stored)
    y_pair = torch.empty((T * k, H), dtype=PAIR_ROWS_DTYPE, device=x.device)
    # per sorted row: reading it per pair in this kernel's epilogue costs GEMM 2 ~170 B of spills
    row_w = _pair_weights(topk_weights)[plan.sorted_pair.long()]
    launch_grouped_wgmma(h, p2, H, plan, y_pair, wgmma_gemm2_config(cfg), gather=False, x_mma_order=True,
                         globals_=_weight_globals(w2), bias=w2_bias, row_weight=row_w, scatter=True)
    return launch_combine(y_pair, topk_ids, k, shared_out, out, w13.shape[0])


def packed_dispatch(topk_ids: torch.Tensor, n_experts: int, cfg):
    """The dispatch plan for the packed kernels' configuration ``cfg``: for ``MMAHeights`` with
    each class's tile map (``DispatchPlan.class_tiles``, written in the plan's own launch where the
    dispatch places its pairs in one: two launches fewer before GEMM 1)."""
    classes = tuple((c.block_m, rows) for c, rows in cfg.classes()) if isinstance(cfg, MMAHeights) else ()
    return dispatch(topk_ids, n_experts, cfg.block_m, classes=classes)


def _run_packed(x, w13, w2, packed, topk_ids, topk_weights, plan, cfg, k, activation, interleaved, w13_bias, w2_bias,
                shared_out, out, fused=None, mode: str = "w4a16", input_global_scale=None):
    """The layer on the packed kernels of ``cfg`` (emulated W4A4: ``_w4a4_activations``)."""
    from .mma_sync import MMAConfig

    requant = None
    if mode == "w4a4":  # emulated: each GEMM's activations quantized, then dequantized for the W4A16 kernels
        x, w13 = _w4a4_activations(x, input_global_scale, w13)
        requant = functools.partial(_w4a4_requantize, w2=w2)
    if isinstance(cfg, (MMAConfig, MMAHeights)):
        return _run_mma(x, w13, w2, packed, topk_ids, topk_weights, plan, cfg, k, activation, interleaved, w13_bias,
                        w2_bias, shared_out, out, fused, requant)
    return _run_wgmma(x, w13, w2, packed, topk_ids, topk_weights, plan, cfg, k, activation, w13_bias, w2_bias,
                      shared_out, out, requant)


def _w4a4_activations(x: torch.Tensor, global_scale: torch.Tensor | None, w: FP4Tensor,
                      k_stored: int | None = None) -> tuple[torch.Tensor, FP4Tensor]:
    """Emulated W4A4 on the packed W4A16 kernels, as ``ops.linear`` runs it: x quantized to NVFP4
    (``global_scale``, or None: dynamic) and dequantized to bf16 without its global scale (exact),
    and ``w`` with its global scales times that one, which the GEMM epilogues apply to the fp32
    sums (before the SwiGLU). In x's order both in one kernel (``fake_quantize_activations``); in
    GEMM 2's MMA K order (``k_stored``, the wgmma path) by the quantizer and the dequantize kernel.
    The product of the globals is formed in that kernel's first program, or by torch where there
    are too many globals for it (per-row globals [E, N] of real layers); it comes back as [E, 1] or
    [E, N], shapes ``_weight_globals`` reads without a copy."""
    from .quantize import MAX_WEIGHT_GLOBALS, fake_quantize_activations

    wv, mode = _weight_globals(w)  # contiguous [E] or [E, N], kept with w's globals: no copy per call
    wg = wv if wv.numel() <= MAX_WEIGHT_GLOBALS else None
    x_hat, g = fake_quantize_activations(x, global_scale, wg, k_stored=k_stored)
    if wg is None:
        g = wv * g
    return x_hat, replace(w, global_scale=g.reshape(-1, 1) if mode == 1 else g)


def _w4a4_requantize(h: torch.Tensor, w2: FP4Tensor, k_stored: int | None = None) -> tuple[torch.Tensor, FP4Tensor]:
    """Emulated W4A4 between the GEMMs: h re-quantized over all its rows with one dynamic global
    scale, as ``_run`` does, then ``_w4a4_activations`` for GEMM 2 (``k_stored``: in its MMA K order)."""
    return _w4a4_activations(h, None, w2, k_stored)
