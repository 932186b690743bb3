"""MoE dispatch plan: token-expert pairs sorted by expert, per-expert offsets, tile -> expert map.

Layers: ``kernels.dispatch`` (@triton.jit bodies) -> ``launch_dispatch`` (grids; one launch when
small, two when the pair blocks are few, four when many) -> ``fp4moe::dispatch`` (torch.library
custom op with a fake) -> ``dispatch`` (public). ``dispatch_reference`` defines the result; the kernels equal it exactly.

Definitions, for ``topk_ids`` [T, k] and pairs p = t * k + slot:

* a pair is *routed* when its id is in [0, E), *dropped* otherwise (OEA's empty slots are -1);
* rows: routed pairs sorted stably by expert, then token, then slot (= by expert, then p);
  ``sorted_token[r]`` is the token row r gathers, ``sorted_pair[r]`` its pair (where the combine
  scatters it), ``pair_row[p]`` the inverse (-1 for dropped pairs). Rows from
  ``expert_offsets[E]`` (the routed count) to T*k - 1 belong to dropped pairs: -1 in both;
* ``expert_counts[e]`` routed pairs of expert e; ``expert_offsets`` [E + 1] their exclusive
  prefix sum;
* tiles: expert e owns ceil(counts[e] / block_m) consecutive tiles (none when it has no pairs);
  tile i covers rows ``[tile_start[i], tile_end[i])`` of ``tile_expert[i]``. The tile
  arrays have the worst-case length ``max_tiles(T*k, E, block_m)``; ``n_tiles`` [1] (on the
  device) is the valid count and the entries past it are -1, so a GEMM launched over
  ``max_tiles`` programs exits early on -1 and nothing waits for the host;
* class tile maps (``classes``): the same for another tile height, over only the experts with
  lo < counts[e] <= hi (``tile_map``); ``dispatch`` writes them with the plan, in the same launch
  where it places the pairs with ``dispatch_place_kernel``.

No host synchronisation and no data-dependent shapes: CUDA-graph capturable at fixed T.
Deterministic: no atomics; every position is an integer count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tuning import current_tuning
from ._runtime import arch_kwargs, interpreting, pdl_kwargs

__all__ = ["DispatchConfig", "DispatchPlan", "TileMap", "dispatch", "dispatch_reference", "launch_dispatch",
           "launch_tile_map", "max_tiles", "tile_map", "tile_map_reference", "compile_requests"]

MAX_EXPERTS = 4095  # buckets (E + 1 with the dropped one) are one register vector
ALL_ROWS = 2**31 - 1  # a class tile map's hi for "no upper bound" (``kernels.dispatch.ALL_ROWS``)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def max_tiles(n_pairs: int, n_experts: int, block_m: int, rows: tuple[int, int] | None = None) -> int:
    """Worst-case number of tiles: sum_e ceil(c_e / block_m) <= ceil(n / block_m) + E, and never
    more than one tile per pair. ``rows`` = (lo, hi): a class tile map's (experts with lo < c_e <=
    hi rows): at most n // (lo + 1) such experts, each of at most ceil(min(hi, n) / block_m) tiles."""
    bound = min(n_pairs, -(-n_pairs // block_m) + n_experts)
    if rows is None:
        return bound
    lo, hi = rows
    experts = min(n_experts, n_pairs // (lo + 1))
    return min(bound, -(-n_pairs // block_m) + experts, experts * -(-min(hi, n_pairs) // block_m))


def check_rows(rows) -> tuple[int, int] | None:
    """A class of experts by their rows, (lo, hi) with 0 <= lo < hi: experts with lo < rows <= hi."""
    if rows is None:
        return None
    if (not isinstance(rows, tuple) or len(rows) != 2 or any(isinstance(r, bool) or not isinstance(r, int)
                                                             for r in rows) or not 0 <= rows[0] < rows[1]):
        raise ValueError(f"rows: expected (lo, hi) ints with 0 <= lo < hi, got {rows!r}")
    return (rows[0], min(rows[1], ALL_ROWS))


@dataclass(frozen=True)
class DispatchConfig:
    """``fused``: one program builds the whole plan (one launch; small T*k): all pairs in one vector
    when they fit ``block_p`` (``dispatch_small_kernel``), else ``block_p`` at a time. Otherwise
    blocks of ``block_p`` pairs per program. ``num_warps`` for every launch."""

    block_p: int
    fused: bool
    num_warps: int

    def __post_init__(self) -> None:
        if self.block_p < 16 or self.block_p & (self.block_p - 1) or self.block_p > 1024:
            raise ValueError(f"DispatchConfig.block_p: expected a power of two in 16..1024, got {self.block_p}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"DispatchConfig.num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")

    def __str__(self) -> str:
        return f"{'fused' if self.fused else 'blocks'}_p{self.block_p}_w{self.num_warps}"

    @staticmethod
    def from_heuristic(n_pairs: int, n_experts: int) -> DispatchConfig:
        """One program with all pairs in one vector (``dispatch_small_kernel``) up to 64 pairs and at
        most ``DispatchTuning.small_max_comparisons`` pair x expert comparisons (past that the
        comparisons swamp one program), else blocks of ~32 pairs; 4 warps up to 8K comparisons, else
        8 (no spills) (docs/performance-engineering.md, ``DispatchTuning.small_max_comparisons``)."""
        block_e = _block_e(n_experts)
        block_p = max(16, _next_pow2(n_pairs))
        if n_pairs <= 64 and block_p * block_e <= current_tuning().dispatch.small_max_comparisons:
            return DispatchConfig(block_p=block_p, fused=True, num_warps=4 if block_p * block_e <= 8192 else 8)
        return DispatchConfig(block_p=max(16, min(128, _next_pow2(-(-n_pairs // 32)))), fused=False, num_warps=4)

    @staticmethod
    def candidates(n_pairs: int, n_experts: int) -> list[DispatchConfig]:
        """Every block size and warp count; fused ones that would run the one-vector program only up
        to ``DispatchTuning.small_max_comparisons`` (past it that program measured 28-54 us at 128 pairs)."""
        most = current_tuning().dispatch.small_max_comparisons
        return [DispatchConfig(bp, fused, w) for fused in (True, False) for bp in (32, 64, 128, 256) for w in (4, 8)
                if not (fused and uses_small_kernel(n_pairs, bp) and bp * _block_e(n_experts) > most)]


def _block_e(n_experts: int) -> int:
    """The fused kernels' expert vector width."""
    return max(16, _next_pow2(n_experts))


def uses_small_kernel(n_pairs: int, block_p: int) -> bool:
    """Whether a fused configuration runs ``dispatch_small_kernel`` (all pairs in one vector) rather
    than the chunked ``dispatch_fused_kernel``: the launcher's and the planner's choice."""
    return n_pairs <= block_p


def uses_place_kernel(n_pairs: int, block_p: int) -> bool:
    """Whether the block path runs ``dispatch_place_kernel`` after the histograms (the launcher's
    and the planner's choice): at most ``DispatchTuning.place_max_blocks`` block histograms."""
    return -(-n_pairs // block_p) <= current_tuning().dispatch.place_max_blocks


@dataclass
class TileMap:
    tile_expert: torch.Tensor  # int32 [max_tiles]: expert of tile i, -1 past n_tiles
    tile_start: torch.Tensor  # int32 [max_tiles]: first row (in the sorted order)
    tile_end: torch.Tensor  # int32 [max_tiles]: one past its last row
    n_tiles: torch.Tensor  # int32 [1]: valid tiles (on the device)
    block_m: int
    rows: tuple[int, int] | None = None  # a class map's (lo, hi) (``tile_map``); None: every expert


@dataclass
class DispatchPlan:
    expert_counts: torch.Tensor  # int32 [E]
    expert_offsets: torch.Tensor  # int32 [E + 1]; expert_offsets[E] = routed pairs
    sorted_token: torch.Tensor  # int32 [T*k]
    sorted_pair: torch.Tensor  # int32 [T*k]
    pair_row: torch.Tensor  # int32 [T*k]
    tiles: TileMap
    top_k: int
    class_tiles: tuple = ()  # TileMap per ``classes`` entry of ``dispatch``

    @property
    def n_experts(self) -> int:
        return self.expert_counts.shape[0]

    # the tile map's arrays, as a grouped GEMM reads them (one program per tile, max_tiles programs)
    @property
    def tile_expert(self) -> torch.Tensor:
        return self.tiles.tile_expert

    @property
    def tile_start(self) -> torch.Tensor:
        return self.tiles.tile_start

    @property
    def tile_end(self) -> torch.Tensor:
        return self.tiles.tile_end

    @property
    def n_tiles(self) -> torch.Tensor:
        return self.tiles.n_tiles

    @property
    def block_m(self) -> int:
        return self.tiles.block_m

    @property
    def max_tiles(self) -> int:
        return self.tiles.tile_expert.shape[0]


# ----------------------------------------------------------------------------------------------
# validation


def _check(topk_ids: torch.Tensor, n_experts: int, block_m: int, *, kernel: bool) -> None:
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids: expected a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids: expected a 2-D tensor [T, k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype != torch.int32:
        raise TypeError(f"topk_ids: expected int32 (routing's output), got {topk_ids.dtype}")
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or not 1 <= n_experts <= MAX_EXPERTS:
        raise ValueError(f"n_experts: expected an int in 1..{MAX_EXPERTS}, got {n_experts!r}")
    k = topk_ids.shape[1]
    if not 1 <= k <= n_experts:
        raise ValueError(f"topk_ids: expected 1..n_experts={n_experts} columns (top-k), got {k}")
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"block_m: expected a positive int, got {block_m!r}")
    if kernel and topk_ids.device.type == "cpu" and not interpreting():
        raise ValueError("topk_ids: CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter); "
                         "move them to a CUDA device")


def _check_values(topk_ids: torch.Tensor, n_experts: int) -> None:
    """Ids must be -1 (dropped) or in [0, E): reads the ids back (one host sync)."""
    bad = (topk_ids < -1) | (topk_ids >= n_experts)
    if bool(bad.any()):
        t, s = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"topk_ids: expected ids in [0, n_experts={n_experts}) or -1 (dropped), "
                         f"got {int(topk_ids[t, s])} at token {t}, slot {s}")


# ----------------------------------------------------------------------------------------------
# reference


def tile_map_reference(expert_counts: torch.Tensor, expert_offsets: torch.Tensor, n_pairs: int,
                       block_m: int, rows: tuple[int, int] | None = None) -> TileMap:
    E = expert_counts.shape[0]
    n = max_tiles(n_pairs, E, block_m, rows)
    lo, hi = rows if rows is not None else (0, ALL_ROWS)
    dev = expert_counts.device
    experts, starts, ends = [], [], []
    for e, (c, o) in enumerate(zip(expert_counts.tolist(), expert_offsets.tolist())):
        if not lo < c <= hi:
            continue
        for s in range(o, o + c, block_m):
            experts.append(e)
            starts.append(s)
            ends.append(min(s + block_m, o + c))
    pad = [-1] * (n - len(experts))
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    return TileMap(tile_expert=as_t(experts + pad), tile_start=as_t(starts + pad), tile_end=as_t(ends + pad),
                   n_tiles=as_t([len(experts)]), block_m=block_m)


def dispatch_reference(topk_ids: torch.Tensor, n_experts: int, block_m: int) -> DispatchPlan:
    """The plan, by a stable sort of the pairs on their expert (dropped pairs last)."""
    _check(topk_ids, n_experts, block_m, kernel=False)
    _check_values(topk_ids, n_experts)
    T, k = topk_ids.shape
    dev = topk_ids.device
    flat = topk_ids.flatten().long()
    routed = flat >= 0
    bucket = torch.where(routed, flat, torch.full_like(flat, n_experts))
    order = torch.sort(bucket, stable=True).indices  # by expert, then pair index = (token, slot)
    sorted_routed = routed[order]
    sorted_pair = torch.where(sorted_routed, order, torch.full_like(order, -1))
    sorted_token = torch.where(sorted_routed, order // k, torch.full_like(order, -1))
    pair_row = torch.full_like(flat, -1)
    pair_row[order[sorted_routed]] = torch.arange(len(order), device=dev)[sorted_routed]
    counts = torch.bincount(flat[routed], minlength=n_experts)
    offsets = torch.zeros(n_experts + 1, dtype=torch.long, device=dev)
    offsets[1:] = torch.cumsum(counts, 0)
    i32 = lambda v: v.to(torch.int32)  # noqa: E731
    return DispatchPlan(expert_counts=i32(counts), expert_offsets=i32(offsets), sorted_token=i32(sorted_token),
                        sorted_pair=i32(sorted_pair), pair_row=i32(pair_row),
                        tiles=tile_map_reference(counts, offsets, T * k, block_m), top_k=k)


# ----------------------------------------------------------------------------------------------
# launcher


def _block_i(block_e: int) -> int:
    """Tile-map entries per program: the grid of the tile-map kernel is cdiv(max_tiles, block_i),
    and each program stores its share of the -1 entries block_i at a time (``_write_tiles``); at
    most ``DispatchTuning.tiles_per_program``, fewer for wide expert vectors (BLOCK_E registers per
    program)."""
    return max(16, min(current_tuning().dispatch.tiles_per_program, 16384 // block_e))


def _block_q(block_p: int, block_e: int) -> int:
    """Pairs per one-hot [block_q, block_e] count: about 8K elements in registers."""
    return max(1, min(block_p, 8192 // block_e))


def class_layout(n_pairs: int, n_experts: int, classes) -> list[tuple[int, int]]:
    """(offset, max tiles) of each class tile map in the one int32 buffer ``dispatch`` writes them
    to: expert, start and end (max tiles each), then the tile count; ``classes``: (block_m, (lo,
    hi)) pairs."""
    layout, at = [], 0
    for block_m, rows in classes:
        n_max = max_tiles(n_pairs, n_experts, block_m, rows)
        layout.append((at, n_max))
        at += 3 * n_max + 1
    return layout


def _class_size(n_pairs: int, n_experts: int, classes) -> int:
    return sum(3 * n_max + 1 for _, n_max in class_layout(n_pairs, n_experts, classes))


def _class_views(buf: torch.Tensor, n_pairs: int, n_experts: int, classes) -> list[tuple]:
    """(expert, start, end, n_tiles) views of each class map in ``buf``."""
    return [(buf[at:at + n], buf[at + n:at + 2 * n], buf[at + 2 * n:at + 3 * n], buf[at + 3 * n:at + 3 * n + 1])
            for at, n in class_layout(n_pairs, n_experts, classes)]


def launch_dispatch(ids: torch.Tensor, n_experts: int, top_k: int, block_m: int, config: DispatchConfig,
                    classes=()):
    """Build the plan from contiguous int32 ids [n_pairs] (n_pairs >= 1). Returns the nine
    tensors in ``DispatchPlan`` field order (tiles flattened: expert, start, end, n_tiles), then
    the buffer of the class tile maps (``class_layout``; ``classes``: (block_m, (lo, hi)) pairs):
    written by the place kernel for up to two classes, else by a ``launch_tile_map`` each."""
    import triton

    from ..kernels.dispatch import (
        dispatch_fused_kernel,
        dispatch_histogram_kernel,
        dispatch_place_kernel,
        dispatch_scan_kernel,
        dispatch_scatter_kernel,
        dispatch_small_kernel,
        dispatch_tiles_kernel,
    )

    n, E = ids.shape[0], n_experts
    dev = ids.device
    n_max = max_tiles(n, E, block_m)
    i32 = dict(dtype=torch.int32, device=dev)
    counts, offsets = torch.empty(E, **i32), torch.empty(E + 1, **i32)
    sorted_token, sorted_pair, pair_row = torch.empty(n, **i32), torch.empty(n, **i32), torch.empty(n, **i32)
    t_expert, t_start, t_end = torch.empty(n_max, **i32), torch.empty(n_max, **i32), torch.empty(n_max, **i32)
    n_tiles = torch.empty(1, **i32)
    class_buf = torch.empty(_class_size(n, E, classes), **i32)
    plan = (counts, offsets, sorted_token, sorted_pair, pair_row, t_expert, t_start, t_end, n_tiles, class_buf)
    w = config.num_warps
    pdl = pdl_kwargs(dev)
    if config.fused and uses_small_kernel(n, config.block_p):
        dispatch_small_kernel[(1,)](ids, counts, offsets, sorted_token, sorted_pair, pair_row, t_expert, t_start,
                                    t_end, n_tiles, n, E, n_max, TOP_K=top_k, BLOCK_M=block_m,
                                    BLOCK_P=config.block_p, BLOCK_E=_block_e(E), num_warps=w, **pdl, **arch_kwargs(dev))
    elif config.fused:
        dispatch_fused_kernel[(1,)](ids, counts, offsets, sorted_token, sorted_pair, pair_row, t_expert, t_start,
                                    t_end, n_tiles, n, E, n_max, TOP_K=top_k, BLOCK_M=block_m,
                                    BLOCK_P=config.block_p, BLOCK_E=_block_e(E), num_warps=w, **pdl, **arch_kwargs(dev))
    else:
        block_e = max(16, _next_pow2(E + 1))  # bucket E: dropped pairs
        n_blocks = triton.cdiv(n, config.block_p)
        hist = torch.empty((n_blocks, block_e), **i32)
        bucket_counts = torch.empty(block_e, **i32)
        block_q = _block_q(config.block_p, block_e)
        dispatch_histogram_kernel[(n_blocks,)](ids, hist, n, E, BLOCK_P=config.block_p, BLOCK_Q=block_q,
                                               BLOCK_E=block_e, num_warps=w, **pdl, **arch_kwargs(dev))
        block_i = _block_i(block_e)
        if uses_place_kernel(n, config.block_p):
            base = torch.empty((n_blocks, block_e), **i32)
            n_cls, args, heights = _place_classes(n, E, classes)
            dispatch_place_kernel[(n_blocks,)](
                ids, hist, base, counts, offsets, n_tiles, t_expert, t_start, t_end, sorted_token, sorted_pair,
                pair_row, n, E, n_blocks, n_max, class_buf, *args, TOP_K=top_k, BLOCK_M=block_m,
                BLOCK_P=config.block_p, BLOCK_Q=min(32, config.block_p), BLOCK_E=block_e, BLOCK_B=current_tuning().dispatch.place_block_b,
                BLOCK_I=block_i, N_CLASSES=n_cls, A_M=heights[0], B_M=heights[1], num_warps=w, **pdl,
                **arch_kwargs(dev))
            if n_cls < len(classes):  # more than the place kernel writes: a launch each
                _class_launches(counts, n, classes, class_buf)
            return plan
        block_c = min(block_e, 64)
        dispatch_scan_kernel[(block_e // block_c,)](hist, bucket_counts, n_blocks, BLOCK_E=block_e, BLOCK_B=16,
                                                    BLOCK_C=block_c, num_warps=w, **pdl, **arch_kwargs(dev))
        dispatch_tiles_kernel[(max(1, triton.cdiv(n_max, block_i)),)](
            bucket_counts, counts, offsets, n_tiles, t_expert, t_start, t_end, n_tiles, block_e, E, n_max, 0, ALL_ROWS,
            BLOCK_M=block_m, BLOCK_I=block_i, BLOCK_E=block_e, STORE_TABLE=True, num_warps=w, **pdl, **arch_kwargs(dev))
        dispatch_scatter_kernel[(n_blocks,)](ids, hist, offsets, sorted_token, sorted_pair, pair_row, n, E,
                                             TOP_K=top_k, BLOCK_P=config.block_p, BLOCK_Q=min(32, config.block_p),
                                             BLOCK_E=block_e, num_warps=w, **pdl, **arch_kwargs(dev))
    _class_launches(counts, n, classes, class_buf)
    return plan


#: class tile maps the place kernel writes in its launch (classes a and b)
PLACE_MAX_CLASSES = 2


def _place_classes(n_pairs: int, n_experts: int, classes) -> tuple[int, list[int], list[int]]:
    """The place kernel's class arguments, for the launcher and the planner: (N_CLASSES, [a_lo,
    a_hi, a_max, b_lo, b_hi, b_max], [A_M, B_M]); none when there are more classes than it writes
    (each then gets a launch of its own), unused slots zero with tile height 1."""
    written = list(classes) if len(classes) <= PLACE_MAX_CLASSES else []
    args, heights = [], []
    for (block_m, (lo, hi)), (_, n_max) in zip(written, class_layout(n_pairs, n_experts, written)):
        args += [lo, hi, n_max]
        heights.append(block_m)
    unused = PLACE_MAX_CLASSES - len(written)
    return len(written), args + [0, 0, 0] * unused, heights + [1] * unused


def _class_launches(counts: torch.Tensor, n_pairs: int, classes, class_buf: torch.Tensor) -> None:
    """The class tile maps one launch each, into their views of ``class_buf``."""
    for (block_m, rows), out in zip(classes, _class_views(class_buf, n_pairs, counts.shape[0], classes)):
        launch_tile_map(counts, n_pairs, block_m, rows, out=out)


def launch_tile_map(expert_counts: torch.Tensor, n_pairs: int, block_m: int, rows: tuple[int, int] | None = None,
                    out: tuple | None = None):
    """Tile map of another ``block_m`` from a plan's expert counts: (expert, start, end, n_tiles);
    ``rows`` = (lo, hi): only the experts with lo < rows <= hi get tiles (``check_rows``);
    ``out``: those four tensors to write (else new ones)."""
    import triton

    from ..kernels.dispatch import dispatch_tiles_kernel

    E = expert_counts.shape[0]
    lo, hi = rows if rows is not None else (0, ALL_ROWS)
    n_max = max_tiles(n_pairs, E, block_m, rows)
    i32 = dict(dtype=torch.int32, device=expert_counts.device)
    if out is None:
        out = torch.empty(n_max, **i32), torch.empty(n_max, **i32), torch.empty(n_max, **i32), torch.empty(1, **i32)
    t_expert, t_start, t_end, n_tiles = out
    if n_pairs == 0 or n_max == 0:
        return t_expert, t_start, t_end, n_tiles.zero_()
    block_e = max(16, _next_pow2(E))
    block_i = _block_i(block_e)
    dispatch_tiles_kernel[(max(1, triton.cdiv(n_max, block_i)),)](
        expert_counts, n_tiles, n_tiles, n_tiles, t_expert, t_start, t_end, n_tiles, E, E, n_max, lo, hi,
        BLOCK_M=block_m, BLOCK_I=block_i, BLOCK_E=block_e, STORE_TABLE=False, num_warps=4,
        **pdl_kwargs(expert_counts.device), **arch_kwargs(expert_counts.device))
    return t_expert, t_start, t_end, n_tiles


# ----------------------------------------------------------------------------------------------
# torch.library custom op


def _classes_from_flat(flat: list[int]) -> list[tuple[int, tuple[int, int]]]:
    return [(flat[i], (flat[i + 1], flat[i + 2])) for i in range(0, len(flat), 3)]


@torch.library.custom_op("fp4moe::dispatch", mutates_args=())
def _dispatch_op(topk_ids: torch.Tensor, n_experts: int, block_m: int, block_p: int, fused: bool,
                 num_warps: int, classes: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                              torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                              torch.Tensor, torch.Tensor]:
    """block_p = 0: heuristic configuration; ``classes``: (block_m, lo, hi) per class tile map."""
    return _dispatch_impl(topk_ids, n_experts, block_m, block_p, fused, num_warps, classes)


def _dispatch_impl(topk_ids, n_experts, block_m, block_p, fused, num_warps, classes):
    """The body of ``fp4moe::dispatch`` (``dispatch`` calls it directly where nothing traces the call)."""
    T, k = topk_ids.shape
    n = T * k
    cls = _classes_from_flat(classes)
    if n == 0:
        return _empty_plan(topk_ids, n_experts, block_m, cls, zero=True)
    cfg = DispatchConfig(block_p, fused, num_warps) if block_p else DispatchConfig.from_heuristic(n, n_experts)
    return launch_dispatch(topk_ids.contiguous().view(-1), n_experts, k, block_m, cfg, cls)


def _empty_plan(topk_ids: torch.Tensor, n_experts: int, block_m: int, classes=(), zero: bool = False):
    n = topk_ids.numel()
    n_max = max_tiles(n, n_experts, block_m)
    i32 = dict(dtype=torch.int32, device=topk_ids.device)
    make = torch.zeros if zero else torch.empty
    return (make(n_experts, **i32), make(n_experts + 1, **i32), torch.empty(n, **i32), torch.empty(n, **i32),
            torch.empty(n, **i32), torch.empty(n_max, **i32), torch.empty(n_max, **i32), torch.empty(n_max, **i32),
            make(1, **i32), make(_class_size(n, n_experts, classes), **i32))


@_dispatch_op.register_fake
def _dispatch_fake(topk_ids, n_experts, block_m, block_p, fused, num_warps, classes):
    return _empty_plan(topk_ids, n_experts, block_m, _classes_from_flat(classes))


@torch.library.custom_op("fp4moe::dispatch_tile_map", mutates_args=())
def _tile_map_op(expert_counts: torch.Tensor, n_pairs: int, block_m: int, rows_lo: int,
                 rows_hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows_lo, rows_hi = 0, ALL_ROWS: every expert."""
    return launch_tile_map_flat(expert_counts, n_pairs, block_m, rows_lo, rows_hi)


def launch_tile_map_flat(expert_counts, n_pairs, block_m, rows_lo, rows_hi):
    """The body of ``fp4moe::dispatch_tile_map`` (``tile_map`` calls it directly where nothing traces)."""
    return launch_tile_map(expert_counts, n_pairs, block_m, (rows_lo, rows_hi))


@_tile_map_op.register_fake
def _tile_map_fake(expert_counts, n_pairs, block_m, rows_lo, rows_hi):
    n_max = max_tiles(n_pairs, expert_counts.shape[0], block_m, (rows_lo, rows_hi))
    return (expert_counts.new_empty(n_max), expert_counts.new_empty(n_max), expert_counts.new_empty(n_max),
            expert_counts.new_empty(1))


# ----------------------------------------------------------------------------------------------
# public function


def dispatch(topk_ids: torch.Tensor, n_experts: int, block_m: int, *, config: DispatchConfig | None = None,
             check_ids: bool = False, classes=()) -> DispatchPlan:
    """The dispatch plan of ``topk_ids`` [T, k] int32 for ``n_experts`` experts and row tiles of
    ``block_m`` (module docstring). Ids outside [0, n_experts) count as dropped (-1);
    ``check_ids=True`` instead raises on any id other than -1 outside that range (one host sync).
    ``classes``: (block_m, (lo, hi)) pairs, a class tile map each in ``plan.class_tiles``, equal
    to ``tile_map(plan, block_m, (lo, hi))`` and made with the plan (in its launch where the
    place kernel runs, for up to two classes). No host synchronisation otherwise."""
    _check(topk_ids, n_experts, block_m, kernel=True)
    if check_ids:
        _check_values(topk_ids, n_experts)
    classes = _check_classes(classes)
    pinned = (config.block_p, config.fused, config.num_warps) if config else (0, False, 0)
    from ._direct import runs_direct

    op = _dispatch_impl if runs_direct(topk_ids) else _dispatch_op
    outs = op(topk_ids, n_experts, block_m, *pinned, [v for m, (lo, hi) in classes for v in (m, lo, hi)])
    counts, offsets, st, sp, pr, te, ts, tend, nt, class_buf = outs
    views = _class_views(class_buf, topk_ids.numel(), n_experts, classes)
    return DispatchPlan(expert_counts=counts, expert_offsets=offsets, sorted_token=st, sorted_pair=sp, pair_row=pr,
                        tiles=TileMap(te, ts, tend, nt, block_m), top_k=topk_ids.shape[1],
                        class_tiles=tuple(TileMap(*v, m, rows) for v, (m, rows) in zip(views, classes)))


def _check_classes(classes) -> list[tuple[int, tuple[int, int]]]:
    if not isinstance(classes, (tuple, list)):
        raise TypeError(f"classes: expected a sequence of (block_m, (lo, hi)), got {type(classes).__name__}")
    out = []
    for c in classes:
        if not (isinstance(c, (tuple, list)) and len(c) == 2):
            raise ValueError(f"classes: expected (block_m, (lo, hi)) pairs, got {c!r}")
        m, rows = c
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"classes: block_m expected a positive int, got {m!r}")
        out.append((m, check_rows(tuple(rows) if isinstance(rows, list) else rows) or (0, ALL_ROWS)))
    return out


def tile_map(plan: DispatchPlan, block_m: int, rows: tuple[int, int] | None = None) -> TileMap:
    """The plan's tile map for another row-tile size (e.g. GEMM 2 tiling rows differently from
    GEMM 1): same rows, same experts; one launch, no host synchronisation. ``rows`` = (lo, hi):
    tiles only for the experts with lo < rows <= hi (a class: the decode GEMMs run the experts of
    few rows with shorter tiles in a launch of their own, ``ops.moe.MMAHeights``)."""
    if not isinstance(plan, DispatchPlan):
        raise TypeError(f"plan: expected a DispatchPlan, got {type(plan).__name__}")
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"block_m: expected a positive int, got {block_m!r}")
    lo, hi = check_rows(rows) or (0, ALL_ROWS)
    from ._direct import runs_direct

    op = launch_tile_map_flat if runs_direct(plan.expert_counts) else _tile_map_op
    te, ts, tend, nt = op(plan.expert_counts, plan.sorted_pair.shape[0], block_m, lo, hi)
    return TileMap(te, ts, tend, nt, block_m, None if rows is None else (lo, hi))


# ----------------------------------------------------------------------------------------------
# planner


def compile_requests(n_pairs: int, n_experts: int, top_k: int, block_m: int, config: DispatchConfig,
                     cc: int, classes=()) -> list:
    """Cross-compilation requests (``fp4moe.plan.crosscompile``) for the launches ``dispatch``
    makes with ``config``: the fused kernel, or the block kernels (histogram, then place, or scan,
    tiles and scatter). ``classes`` as ``dispatch``'s: the place kernel writes up to two."""
    from ..target.compile_request import CompileRequest

    from ..target import get_arch

    i32 = "*i32"
    w = config.num_warps
    pdl = int(get_arch(cc).has_pdl)
    if config.fused:
        kernel = "dispatch_small_kernel" if uses_small_kernel(n_pairs, config.block_p) else "dispatch_fused_kernel"
        names = ("ids_ptr", "counts_ptr", "offsets_ptr", "sorted_token_ptr", "sorted_pair_ptr", "pair_row_ptr",
                 "tile_expert_ptr", "tile_start_ptr", "tile_end_ptr", "n_tiles_ptr")
        sig = {**{n: i32 for n in names}, "n_pairs": "i32", "E": "i32", "max_tiles": "i32"}
        return [CompileRequest(f"fp4moe.kernels.dispatch:{kernel}", sig,
                               {"TOP_K": top_k, "BLOCK_M": block_m, "BLOCK_P": config.block_p,
                                "BLOCK_E": _block_e(n_experts), "PDL": pdl}, cc, w, 1)]
    block_e = max(16, _next_pow2(n_experts + 1))
    histogram = CompileRequest("fp4moe.kernels.dispatch:dispatch_histogram_kernel",
                               {"ids_ptr": i32, "hist_ptr": i32, "n_pairs": "i32", "E": "i32"},
                               {"BLOCK_P": config.block_p, "BLOCK_Q": _block_q(config.block_p, block_e),
                                "BLOCK_E": block_e, "PDL": pdl}, cc, w, 1)
    if uses_place_kernel(n_pairs, config.block_p):
        names = ("ids_ptr", "hist_ptr", "base_ptr", "counts_ptr", "offsets_ptr", "n_tiles_ptr", "tile_expert_ptr",
                 "tile_start_ptr", "tile_end_ptr", "sorted_token_ptr", "sorted_pair_ptr", "pair_row_ptr")
        n_cls, _, heights = _place_classes(n_pairs, n_experts, _check_classes(classes))
        return [histogram, CompileRequest(
            "fp4moe.kernels.dispatch:dispatch_place_kernel",
            {**{n: i32 for n in names}, "n_pairs": "i32", "E": "i32", "n_blocks": "i32", "max_tiles": "i32",
             "class_ptr": i32, **{f"{c}_{v}": "i32" for c in "ab" for v in ("lo", "hi", "max")}},
            {"TOP_K": top_k, "BLOCK_M": block_m, "BLOCK_P": config.block_p, "BLOCK_Q": min(32, config.block_p),
             "BLOCK_E": block_e, "BLOCK_B": current_tuning().dispatch.place_block_b, "BLOCK_I": _block_i(block_e), "N_CLASSES": n_cls,
             "A_M": heights[0], "B_M": heights[1], "PDL": pdl}, cc, w, 1)]
    return [
        histogram,
        CompileRequest("fp4moe.kernels.dispatch:dispatch_scan_kernel",
                       {"hist_ptr": i32, "bucket_counts_ptr": i32, "n_blocks": "i32"},
                       {"BLOCK_E": block_e, "BLOCK_B": 16, "BLOCK_C": min(block_e, 64), "PDL": pdl}, cc, w, 1),
        CompileRequest("fp4moe.kernels.dispatch:dispatch_tiles_kernel",
                       {**{n: i32 for n in ("bucket_counts_ptr", "counts_ptr", "offsets_ptr", "n_tiles_ptr",
                                            "tile_expert_ptr", "tile_start_ptr", "tile_end_ptr",
                                            "n_tiles_out_ptr")},
                        "n_buckets": "i32", "E": "i32", "max_tiles": "i32", "rows_lo": "i32", "rows_hi": "i32"},
                       {"BLOCK_M": block_m, "BLOCK_I": _block_i(block_e), "BLOCK_E": block_e, "STORE_TABLE": True,
                        "PDL": pdl},
                       cc, w, 1),
        CompileRequest("fp4moe.kernels.dispatch:dispatch_scatter_kernel",
                       {**{n: i32 for n in ("ids_ptr", "hist_ptr", "offsets_ptr", "sorted_token_ptr",
                                            "sorted_pair_ptr", "pair_row_ptr")}, "n_pairs": "i32", "E": "i32"},
                       {"TOP_K": top_k, "BLOCK_P": config.block_p, "BLOCK_Q": min(32, config.block_p),
                        "BLOCK_E": block_e, "PDL": pdl}, cc, w, 1),
    ]
