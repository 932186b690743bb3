"""MoE dispatch: @triton.jit bodies (launchers and the torch reference in ``fp4moe.ops.dispatch``).

Input: the flattened routing ids ``ids[p]`` for pairs p = t * TOP_K + slot. A pair whose id is
not in [0, E) (OEA's -1) is *dropped*: it goes to a virtual bucket E after the real experts.
The order is canonical, no atomics anywhere: a pair's row is

    row(p) = offsets[e] + #{q < p : ids[q] == e}          (e = bucket of p)

i.e. sorted by expert, then token, then slot; every count is an integer sum, so the result is
deterministic and equals the reference's stable sort.

Three ways to get there:
  * ``dispatch_small_kernel``: one program, all pairs in one vector (decode): every position a
    count over pairs ([BLOCK_P, BLOCK_P] comparisons), no scan;
  * ``dispatch_fused_kernel``: one program does everything, BLOCK_P pairs at a time (one launch);
    its expert vectors are next_pow2(E) wide, the dropped pairs counted on the side.
  * ``dispatch_histogram_kernel`` -> ``dispatch_scan_kernel`` -> ``dispatch_tiles_kernel`` ->
    ``dispatch_scatter_kernel``: per-block histograms, their exclusive scan along the blocks,
    offsets and tile map, then each block scatters its pairs (large T*k, prefill); buckets are
    next_pow2(E + 1) wide, bucket E holding the dropped pairs. Where the blocks are few (decode
    batches of hundreds of tokens), ``dispatch_place_kernel`` does the last three in one launch,
    every program reading all the block histograms.

Tile map: expert e with c_e pairs owns ceil(c_e / BLOCK_M) consecutive tiles; tile i covers rows
[start, end) of one expert. Tiles past the valid count are -1 in all three arrays. A *class* tile
map (``dispatch_tiles_kernel`` with ``rows_lo``, ``rows_hi``) gives tiles only to the experts with
rows_lo < c_e <= rows_hi, at the rows of the whole plan: the grouped GEMMs run experts of few rows
and experts of more rows as two launches with different tile heights over one plan.
"""

import triton
import triton.language as tl

from .pdl import pdl_enter

#: ``rows_hi`` of a tile map over every expert (no class)
ALL_ROWS = tl.constexpr(2**31 - 1)


@triton.jit
def _buckets(ids_ptr, offs, n_pairs, E):
    """Bucket of each pair (its expert, E when dropped) and the in-range mask."""
    p_mask = offs < n_pairs
    e = tl.load(ids_ptr + offs, mask=p_mask, other=0)
    return tl.where((e >= 0) & (e < E), e, E), p_mask


@triton.jit
def _count(e, p_mask, BLOCK_E: tl.constexpr):
    """[BLOCK_E] number of in-range pairs in each bucket (one-hot sum; tl.histogram has had
    GPU-only bugs with replicated layouts, so it is not used)."""
    cols = tl.arange(0, BLOCK_E)
    return tl.sum(((e[:, None] == cols[None, :]) & p_mask[:, None]).to(tl.int32), axis=0)


@triton.jit
def _gather(vec, idx):
    """vec[idx] for a [BLOCK_E] register vector and [N] indices (one-hot reduction)."""
    cols = tl.arange(0, vec.shape[0])
    return tl.sum(tl.where(cols[None, :] == idx[:, None], vec[None, :], 0), axis=1)


@triton.jit
def _expert_tiles(counts, E, BLOCK_M: tl.constexpr, rows_lo, rows_hi):
    """[BLOCK_E] tiles of each expert: ceil(count / BLOCK_M) for experts 0..E-1 with rows_lo <
    count <= rows_hi, else 0."""
    cols = tl.arange(0, counts.shape[0])
    keep = (cols < E) & (counts > rows_lo) & (counts <= rows_hi)
    return tl.where(keep, (counts + BLOCK_M - 1) // BLOCK_M, 0)


@triton.jit
def _write_tiles(tile_expert_ptr, tile_start_ptr, tile_end_ptr, part, n_parts, max_tiles, counts, offsets, tiles_incl,
                 n_tiles, E, BLOCK_M: tl.constexpr, rows_lo, rows_hi, BLOCK_I: tl.constexpr):
    """Part ``part`` of ``n_parts`` of the tile map. ``counts``, ``offsets`` (exclusive) and
    ``tiles_incl`` (inclusive prefix sum of the tiles per expert, ``_expert_tiles`` with the same
    ``rows_lo``, ``rows_hi``) are [BLOCK_E] vectors.

    Expert-major: step j writes the j-th tile of every expert that has one (a [BLOCK_E] store at
    the expert's first tile + j), the parts taking the steps in turn; then the -1 entries
    [n_tiles, max_tiles), BLOCK_I per part in turn. Work grows with the largest expert's tiles, not
    with tiles x experts (a search of each tile's expert costs [tiles, BLOCK_E] one-hot gathers)."""
    cols = tl.arange(0, counts.shape[0])
    tiles = _expert_tiles(counts, E, BLOCK_M, rows_lo, rows_hi)
    first = tiles_incl - tiles
    end_e = offsets + counts
    for j in range(part, tl.max(tiles, axis=0), n_parts):
        has = j < tiles
        start = offsets + j * BLOCK_M
        tl.store(tile_expert_ptr + first + j, cols, mask=has)
        tl.store(tile_start_ptr + first + j, start, mask=has)
        tl.store(tile_end_ptr + first + j, tl.minimum(start + BLOCK_M, end_e), mask=has)
    unused = tl.full([BLOCK_I], -1, tl.int32)
    for i0 in range(n_tiles + part * BLOCK_I, max_tiles, n_parts * BLOCK_I):
        ti = i0 + tl.arange(0, BLOCK_I)
        t_mask = ti < max_tiles
        tl.store(tile_expert_ptr + ti, unused, mask=t_mask)
        tl.store(tile_start_ptr + ti, unused, mask=t_mask)
        tl.store(tile_end_ptr + ti, unused, mask=t_mask)


@triton.jit
def _expert_table(counts, E, BLOCK_M: tl.constexpr, rows_lo, rows_hi):
    """From bucket counts [BLOCK_E] (experts 0..E-1, then perhaps the dropped bucket E):
    (exclusive offsets, inclusive tile prefix sum, tile count); tiles as ``_expert_tiles``."""
    offsets = tl.cumsum(counts, axis=0) - counts
    tiles = _expert_tiles(counts, E, BLOCK_M, rows_lo, rows_hi)
    return offsets, tl.cumsum(tiles, axis=0), tl.sum(tiles, axis=0)


@triton.jit
def _store_expert_table(counts_ptr, offsets_ptr, n_tiles_ptr, counts, offsets, n_routed, n_tiles, E):
    cols = tl.arange(0, counts.shape[0])
    tl.store(counts_ptr + cols, counts, mask=cols < E)
    tl.store(offsets_ptr + cols, offsets, mask=cols < E)
    first = cols == 0
    tl.store(offsets_ptr + E + cols, tl.where(first, n_routed, 0), mask=first)  # offsets[E]: routed pairs
    tl.store(n_tiles_ptr + cols, tl.where(first, n_tiles, 0), mask=first)


@triton.jit
def _store_rows(sorted_token_ptr, sorted_pair_ptr, pair_row_ptr, offs, e, row, p_mask, E, TOP_K: tl.constexpr):
    routed = e < E
    tl.store(sorted_token_ptr + row, tl.where(routed, offs // TOP_K, -1), mask=p_mask)
    tl.store(sorted_pair_ptr + row, tl.where(routed, offs, -1), mask=p_mask)
    tl.store(pair_row_ptr + offs, tl.where(routed, row, -1), mask=p_mask)


@triton.jit
def dispatch_fused_kernel(
    ids_ptr,  # [n_pairs] int32 expert of pair p = t * TOP_K + slot
    counts_ptr,  # [E] int32 out: pairs per expert
    offsets_ptr,  # [E + 1] int32 out: exclusive prefix sum of counts; offsets[E] = routed pairs
    sorted_token_ptr,  # [n_pairs] int32 out: token of row r (-1 for the dropped rows at the end)
    sorted_pair_ptr,  # [n_pairs] int32 out: pair of row r (-1 for dropped rows)
    pair_row_ptr,  # [n_pairs] int32 out: row of pair p (-1 when dropped)
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,  # [max_tiles] int32 out (-1 past n_tiles)
    n_tiles_ptr,  # [1] int32 out
    n_pairs, E, max_tiles,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    """Grid (1,): the whole dispatch plan in one program (BLOCK_E >= E; the dropped pairs are
    counted apart from the experts' vector).

    Pass 1 counts each expert, BLOCK_P pairs at a time; pass 2 gives each pair its row:
    offsets[e] + pairs of e in earlier chunks (running ``seen``) + earlier pairs of e in its own
    chunk (a BLOCK_P x BLOCK_P comparison); pass 3 writes the tile map."""
    pdl_enter(PDL)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, n_pairs, BLOCK_P):
        e, p_mask = _buckets(ids_ptr, p0 + tl.arange(0, BLOCK_P), n_pairs, E)
        counts += _count(e, p_mask & (e < E), BLOCK_E)
    offsets, tiles_incl, n_tiles = _expert_table(counts, E, BLOCK_M, 0, ALL_ROWS)
    n_routed = tl.sum(counts, axis=0)
    _store_expert_table(counts_ptr, offsets_ptr, n_tiles_ptr, counts, offsets, n_routed, n_tiles, E)

    seen = tl.zeros([BLOCK_E], tl.int32)
    seen_dropped = n_routed  # the next free row for a dropped pair
    lane = tl.arange(0, BLOCK_P)
    for p0 in range(0, n_pairs, BLOCK_P):
        offs = p0 + lane
        e, p_mask = _buckets(ids_ptr, offs, n_pairs, E)
        routed = e < E
        earlier = (e[:, None] == e[None, :]) & (lane[None, :] < lane[:, None]) & p_mask[None, :]
        base = tl.where(routed, _gather(offsets + seen, e), seen_dropped)
        row = base + tl.sum(earlier.to(tl.int32), axis=1)
        _store_rows(sorted_token_ptr, sorted_pair_ptr, pair_row_ptr, offs, e, row, p_mask, E, TOP_K)
        seen += _count(e, p_mask & routed, BLOCK_E)
        seen_dropped += tl.sum((p_mask & (~routed)).to(tl.int32), axis=0)

    _write_tiles(tile_expert_ptr, tile_start_ptr, tile_end_ptr, 0, 1, max_tiles, counts, offsets, tiles_incl, n_tiles,
                 E, BLOCK_M, 0, ALL_ROWS, BLOCK_P)


@triton.jit
def dispatch_small_kernel(
    ids_ptr, counts_ptr, offsets_ptr, sorted_token_ptr, sorted_pair_ptr, pair_row_ptr,  # as dispatch_fused_kernel
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, n_tiles_ptr,
    n_pairs, E, max_tiles,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    """Grid (1,), n_pairs <= BLOCK_P (decode): ``dispatch_fused_kernel``'s plan with every position
    a count over pairs, so the dependent chain is two [BLOCK_P, BLOCK_P] comparison sums instead of
    the fused kernel's scans and one-hot gathers over the experts:

        row(p)   = #{q : b_q < b_p} + #{q < p : b_q == b_p}      (b = bucket, dropped pairs = E)
        tile(p)  = #{q : q starts a tile and row(q) < row(p)}    for p that starts a tile, i.e. a
                   routed pair whose rank among its expert's pairs is a multiple of BLOCK_M
        counts[e] = #{q : b_q == e},  offsets[e] = #{q : b_q < e}   ([BLOCK_P, BLOCK_E], off the chain)
    """
    pdl_enter(PDL)
    lane = tl.arange(0, BLOCK_P)
    e, p_mask = _buckets(ids_ptr, lane, n_pairs, E)
    b = tl.where(p_mask, e, E + 1)  # lanes past n_pairs sort after every pair and count nowhere
    routed = p_mask & (e < E)
    same = b[None, :] == b[:, None]  # [p, q]
    before = lane[None, :] < lane[:, None]
    rank = tl.sum((same & before).to(tl.int32), axis=1)  # earlier pairs of p's bucket
    first = tl.sum((b[None, :] < b[:, None]).to(tl.int32), axis=1)  # the bucket's first row
    count = tl.sum(same.to(tl.int32), axis=1)
    row = first + rank
    _store_rows(sorted_token_ptr, sorted_pair_ptr, pair_row_ptr, lane, e, row, p_mask, E, TOP_K)

    starts = routed & (rank % BLOCK_M == 0)
    ti = tl.sum((starts[None, :] & (row[None, :] < row[:, None])).to(tl.int32), axis=1)
    n_tiles = tl.sum(starts.to(tl.int32), axis=0)
    tl.store(tile_expert_ptr + ti, e, mask=starts)
    tl.store(tile_start_ptr + ti, row, mask=starts)
    tl.store(tile_end_ptr + ti, tl.minimum(row + BLOCK_M, first + count), mask=starts)
    unused = (lane >= n_tiles) & (lane < max_tiles)  # max_tiles <= n_pairs <= BLOCK_P
    tl.store(tile_expert_ptr + lane, tl.full([BLOCK_P], -1, tl.int32), mask=unused)
    tl.store(tile_start_ptr + lane, tl.full([BLOCK_P], -1, tl.int32), mask=unused)
    tl.store(tile_end_ptr + lane, tl.full([BLOCK_P], -1, tl.int32), mask=unused)

    cols = tl.arange(0, BLOCK_E)
    counts = tl.sum((b[:, None] == cols[None, :]).to(tl.int32), axis=0)
    offsets = tl.sum((b[:, None] < cols[None, :]).to(tl.int32), axis=0)
    _store_expert_table(counts_ptr, offsets_ptr, n_tiles_ptr, counts, offsets, tl.sum(routed.to(tl.int32), axis=0),
                        n_tiles, E)


@triton.jit
def dispatch_histogram_kernel(
    ids_ptr,  # [n_pairs] int32
    hist_ptr,  # [n_blocks, BLOCK_E] int32 out: pairs per bucket in each block of BLOCK_P pairs
    n_pairs, E,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    """Grid (n_blocks,): one program counts the buckets of pairs [pid*BLOCK_P, (pid+1)*BLOCK_P),
    BLOCK_Q pairs at a time."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for q0 in range(0, BLOCK_P, BLOCK_Q):
        e, p_mask = _buckets(ids_ptr, pid * BLOCK_P + q0 + tl.arange(0, BLOCK_Q), n_pairs, E)
        counts += _count(e, p_mask, BLOCK_E)
    tl.store(hist_ptr + pid * BLOCK_E + tl.arange(0, BLOCK_E), counts)


@triton.jit
def dispatch_scan_kernel(
    hist_ptr,  # [n_blocks, BLOCK_E] int32 in: block histograms; out: exclusive scan along blocks
    bucket_counts_ptr,  # [BLOCK_E] int32 out: pairs per bucket
    n_blocks,
    BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    """Grid (BLOCK_E // BLOCK_C,): one program scans buckets [pid*BLOCK_C, (pid+1)*BLOCK_C) over
    all blocks, BLOCK_B blocks at a time, so hist[b, e] becomes the pairs of e in blocks < b."""
    pdl_enter(PDL)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    carry = tl.zeros([BLOCK_C], tl.int32)
    for b0 in range(0, n_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        ptrs = hist_ptr + blocks[:, None] * BLOCK_E + cols[None, :]
        b_mask = (blocks < n_blocks)[:, None] & (cols[None, :] >= 0)
        h = tl.load(ptrs, mask=b_mask, other=0)
        tl.store(ptrs, tl.cumsum(h, axis=0) - h + carry[None, :], mask=b_mask)
        carry += tl.sum(h, axis=0)
    tl.store(bucket_counts_ptr + cols, carry)


@triton.jit
def dispatch_tiles_kernel(
    bucket_counts_ptr,  # [n_buckets] int32: pairs per expert (then, when n_buckets > E, the dropped bucket)
    counts_ptr, offsets_ptr, n_tiles_ptr,  # [E], [E + 1], [1] int32 out (program 0, STORE_TABLE)
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,  # [max_tiles] int32 out
    n_tiles_out_ptr,  # [1] int32 out: valid tiles
    n_buckets, E, max_tiles,
    rows_lo, rows_hi,  # tiles only for the experts with rows_lo < count <= rows_hi (0, ALL_ROWS: all)
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_E: tl.constexpr, STORE_TABLE: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    """Grid (max(1, cdiv(max_tiles, BLOCK_I)),): every program derives offsets and tile counts
    from the bucket counts (cheap: one [BLOCK_E] scan); program 0 stores them (STORE_TABLE) and
    the tile count; the programs share out the writing of the map (``_write_tiles``'s parts)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    counts = tl.load(bucket_counts_ptr + cols, mask=cols < n_buckets, other=0)
    offsets, tiles_incl, n_tiles = _expert_table(counts, E, BLOCK_M, rows_lo, rows_hi)
    if pid == 0:
        if STORE_TABLE:
            n_routed = tl.sum(tl.where(cols < E, counts, 0), axis=0)
            _store_expert_table(counts_ptr, offsets_ptr, n_tiles_ptr, counts, offsets, n_routed, n_tiles, E)
        else:
            tl.store(n_tiles_out_ptr + cols, tl.where(cols == 0, n_tiles, 0), mask=cols == 0)
    _write_tiles(tile_expert_ptr, tile_start_ptr, tile_end_ptr, pid, tl.num_programs(0), max_tiles, counts, offsets,
                 tiles_incl, n_tiles, E, BLOCK_M, rows_lo, rows_hi, BLOCK_I)


@triton.jit
def dispatch_scatter_kernel(
    ids_ptr,  # [n_pairs] int32
    hist_ptr,  # [n_blocks, BLOCK_E] int32: pairs of each bucket in earlier blocks (scanned)
    offsets_ptr,  # [E + 1] int32: exclusive offsets (offsets[E]: first dropped row)
    sorted_token_ptr, sorted_pair_ptr, pair_row_ptr,  # [n_pairs] int32 out
    n_pairs, E,
    TOP_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    """Grid (n_blocks,): one program places pairs [pid*BLOCK_P, (pid+1)*BLOCK_P): row =
    offsets[e] + pairs of e in earlier blocks + earlier pairs of e in this block (compared
    BLOCK_Q at a time)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    _scatter_block(ids_ptr, offsets_ptr, hist_ptr + pid * BLOCK_E, sorted_token_ptr, sorted_pair_ptr, pair_row_ptr,
                   pid * BLOCK_P, n_pairs, E, TOP_K, BLOCK_P, BLOCK_Q, True)


@triton.jit
def _scatter_block(ids_ptr, first_ptr, before_ptr, sorted_token_ptr, sorted_pair_ptr, pair_row_ptr, p0, n_pairs, E,
                   TOP_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, HAS_BEFORE: tl.constexpr):
    """Rows of pairs [p0, p0 + BLOCK_P): first_ptr[e] (+ before_ptr[e] when HAS_BEFORE: the
    bucket's first row, its pairs in earlier blocks) + earlier pairs of e in this block (compared
    BLOCK_Q at a time)."""
    lane = tl.arange(0, BLOCK_P)
    offs = p0 + lane
    e, p_mask = _buckets(ids_ptr, offs, n_pairs, E)
    row = tl.load(first_ptr + e, mask=p_mask, other=0)
    if HAS_BEFORE:
        row += tl.load(before_ptr + e, mask=p_mask, other=0)
    q_lane = tl.arange(0, BLOCK_Q)
    for q0 in range(0, BLOCK_P, BLOCK_Q):
        eq, q_mask = _buckets(ids_ptr, p0 + q0 + q_lane, n_pairs, E)
        earlier = (e[:, None] == eq[None, :]) & ((q0 + q_lane)[None, :] < lane[:, None]) & q_mask[None, :]
        row += tl.sum(earlier.to(tl.int32), axis=1)
    _store_rows(sorted_token_ptr, sorted_pair_ptr, pair_row_ptr, offs, e, row, p_mask, E, TOP_K)


@triton.jit
def dispatch_place_kernel(
    ids_ptr,  # [n_pairs] int32
    hist_ptr,  # [n_blocks, BLOCK_E] int32 in: pairs per bucket in each block (dispatch_histogram_kernel)
    base_ptr,  # [n_blocks, BLOCK_E] int32 scratch: each program's first row of every bucket
    counts_ptr, offsets_ptr, n_tiles_ptr,  # [E], [E + 1], [1] int32 out (program 0)
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,  # [max_tiles] int32 out
    sorted_token_ptr, sorted_pair_ptr, pair_row_ptr,  # [n_pairs] int32 out
    n_pairs, E, n_blocks, max_tiles,
    class_ptr,  # int32 out: N_CLASSES class tile maps, each [expert | start | end (max tiles each), n_tiles]
    a_lo, a_hi, a_max, b_lo, b_hi, b_max,  # classes a, b: rows (lo, hi] of their experts, max tiles
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_I: tl.constexpr,
    N_CLASSES: tl.constexpr, A_M: tl.constexpr, B_M: tl.constexpr,  # class maps (0..2) and their tile heights
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    """Grid (n_blocks,): ``dispatch_scan_kernel``, ``dispatch_tiles_kernel`` and
    ``dispatch_scatter_kernel`` in one launch where the blocks are few: every program reads all the
    block histograms (BLOCK_B rows at a time) for the bucket totals and its own blocks' prefix,
    keeps its first row of each bucket in ``base`` (read back by the pairs' buckets after a
    barrier: a [BLOCK_P, BLOCK_E] one-hot gather costs more), places its block's pairs and writes
    its part of the tile map and of the N_CLASSES class tile maps (``_class_tiles``, class b's
    after class a's in ``class_ptr``); program 0 stores the expert table."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    before = tl.zeros([BLOCK_E], tl.int32)
    for b0 in range(0, n_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        h = tl.load(hist_ptr + blocks[:, None] * BLOCK_E + cols[None, :], mask=(blocks < n_blocks)[:, None], other=0)
        counts += tl.sum(h, axis=0)
        before += tl.sum(tl.where((blocks < pid)[:, None], h, 0), axis=0)
    offsets, tiles_incl, n_tiles = _expert_table(counts, E, BLOCK_M, 0, ALL_ROWS)
    if pid == 0:
        n_routed = tl.sum(tl.where(cols < E, counts, 0), axis=0)
        _store_expert_table(counts_ptr, offsets_ptr, n_tiles_ptr, counts, offsets, n_routed, n_tiles, E)
    tl.store(base_ptr + pid * BLOCK_E + cols, offsets + before)
    tl.debug_barrier()  # the program's own global stores, visible to all its threads
    _scatter_block(ids_ptr, base_ptr + pid * BLOCK_E, base_ptr, sorted_token_ptr, sorted_pair_ptr, pair_row_ptr,
                   pid * BLOCK_P, n_pairs, E, TOP_K, BLOCK_P, BLOCK_Q, False)
    _write_tiles(tile_expert_ptr, tile_start_ptr, tile_end_ptr, pid, tl.num_programs(0), max_tiles, counts, offsets,
                 tiles_incl, n_tiles, E, BLOCK_M, 0, ALL_ROWS, BLOCK_I)
    if N_CLASSES >= 1:
        _class_tiles(class_ptr, a_max, pid, tl.num_programs(0), counts, offsets, E, A_M, a_lo, a_hi, BLOCK_I)
    if N_CLASSES >= 2:
        _class_tiles(class_ptr + 3 * a_max + 1, b_max, pid, tl.num_programs(0), counts, offsets, E, B_M, b_lo, b_hi,
                     BLOCK_I)


@triton.jit
def _class_tiles(map_ptr, max_tiles, part, n_parts, counts, offsets, E, BLOCK_M: tl.constexpr, rows_lo, rows_hi,
                 BLOCK_I: tl.constexpr):
    """Part ``part`` of a class tile map (the experts with rows_lo < count <= rows_hi) into one
    buffer: expert, start and end (``max_tiles`` each), then the tile count (part 0)."""
    cols = tl.arange(0, counts.shape[0])
    tiles_incl = tl.cumsum(_expert_tiles(counts, E, BLOCK_M, rows_lo, rows_hi), axis=0)
    n_tiles = tl.max(tiles_incl, axis=0)
    if part == 0:
        tl.store(map_ptr + 3 * max_tiles + cols, tl.where(cols == 0, n_tiles, 0), mask=cols == 0)
    _write_tiles(map_ptr, map_ptr + max_tiles, map_ptr + 2 * max_tiles, part, n_parts, max_tiles, counts, offsets,
                 tiles_incl, n_tiles, E, BLOCK_M, rows_lo, rows_hi, BLOCK_I)
