"""MoE dispatch plan kernels against the torch reference (exact integers), plus its invariants."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fp4moe.tuning import tuning
from fp4moe.ops.dispatch import (
    DispatchConfig,
    DispatchPlan,
    dispatch,
    dispatch_reference,
    max_tiles,
    tile_map,
    tile_map_reference,
)

FUSED = DispatchConfig(block_p=16, fused=True, num_warps=4)  # 16-pair chunks: several chunks per plan
BLOCKS = DispatchConfig(block_p=16, fused=False, num_warps=4)  # 16-pair blocks: several programs
SMALL = DispatchConfig(block_p=512, fused=True, num_warps=4)  # every case's pairs in one vector: dispatch_small_kernel
CONFIGS = {"heuristic": None, "fused": FUSED, "blocks": BLOCKS, "small": SMALL}

PLAN_FIELDS = ("expert_counts", "expert_offsets", "sorted_token", "sorted_pair", "pair_row")
TILE_FIELDS = ("tile_expert", "tile_start", "tile_end", "n_tiles")


def assert_same_plan(out: DispatchPlan, ref: DispatchPlan) -> None:
    for name in PLAN_FIELDS:
        a, b = getattr(out, name).cpu(), getattr(ref, name).cpu()
        assert a.dtype == torch.int32 and a.shape == b.shape, f"{name}: {a.dtype} {tuple(a.shape)} vs {tuple(b.shape)}"
        assert torch.equal(a, b), f"{name}: first difference at {(a != b).nonzero()[0].item()}\n{a}\n{b}"
    for name in TILE_FIELDS:
        a, b = getattr(out.tiles, name).cpu(), getattr(ref.tiles, name).cpu()
        assert a.shape == b.shape and torch.equal(a, b), f"tiles.{name}:\n{a}\n{b}"
    assert out.tiles.block_m == ref.tiles.block_m and out.top_k == ref.top_k


def check_invariants(ids: torch.Tensor, E: int, block_m: int, plan: DispatchPlan) -> None:
    """What the GEMMs and the combine rely on, checked from the definitions (not the reference)."""
    ids = ids.cpu()
    T, k = ids.shape
    flat = ids.flatten()
    routed = (flat >= 0) & (flat < E)
    n = int(routed.sum())
    counts, offsets = plan.expert_counts.cpu(), plan.expert_offsets.cpu()
    st, sp, pr = plan.sorted_token.cpu(), plan.sorted_pair.cpu(), plan.pair_row.cpu()
    assert counts.tolist() == torch.bincount(flat[routed].long(), minlength=E).tolist()
    assert offsets[0] == 0 and offsets[-1] == n and torch.equal(offsets[1:] - offsets[:-1], counts)
    # rows < n: a permutation of the routed pairs, by expert, then pair index (token, slot)
    assert sorted(sp[:n].tolist()) == sorted(routed.nonzero().flatten().tolist())
    experts = flat[sp[:n].long()]
    key = experts.long() * (T * k) + sp[:n].long()
    assert bool((key[1:] > key[:-1]).all())
    assert torch.equal(st[:n], sp[:n] // k)
    assert bool((st[n:] == -1).all()) and bool((sp[n:] == -1).all())
    # pair_row is the inverse; dropped pairs have none
    assert torch.equal(pr[sp[:n].long()], torch.arange(n, dtype=torch.int32))
    assert bool((pr[~routed] == -1).all())
    # tiles: cover every routed row once, each inside one expert, at most block_m rows
    tiles = plan.tiles
    te, ts, tend = tiles.tile_expert.cpu(), tiles.tile_start.cpu(), tiles.tile_end.cpu()
    nt = int(tiles.n_tiles)
    assert te.shape[0] == max_tiles(T * k, E, block_m)
    assert nt == sum(-(-int(c) // block_m) for c in counts)
    assert bool((te[nt:] == -1).all()) and bool((ts[nt:] == -1).all()) and bool((tend[nt:] == -1).all())
    covered = torch.zeros(n, dtype=torch.int32)
    for i in range(nt):
        e, s, t = int(te[i]), int(ts[i]), int(tend[i])
        assert counts[e] > 0 and offsets[e] <= s < t <= offsets[e + 1] and t - s <= block_m
        covered[s:t] += 1
    assert bool((covered == 1).all())
    assert te[:nt].tolist() == sorted(te[:nt].tolist())


@dataclass(frozen=True)
class Case:
    T: int
    k: int
    E: int
    block_m: int
    pattern: str
    why: str


CASES = [
    Case(33, 8, 256, 16, "random", "GLM-5 top-8, T past a 16-row tile"),
    Case(5, 2, 8, 4, "random", "Mixtral-like, a few tokens"),
    Case(1, 8, 257, 16, "random", "one token, prime E: 249 experts without tokens"),
    Case(40, 1, 160, 8, "one_expert", "every token routed to one expert (top-1): one expert, 5 tiles"),
    Case(20, 4, 8, 16, "same_experts", "every token on the same 4 experts; the other 4 empty"),
    Case(9, 8, 8, 4, "random", "top-k = E: every token on every expert"),
    Case(33, 8, 160, 16, "oea_dropped", "OEA's -1 slots: dropped pairs sorted last"),
    Case(17, 3, 12, 1, "random", "block_m = 1: one tile per pair (max_tiles = T*k)"),
    Case(6, 4, 64, 128, "skewed", "block_m larger than any expert's count"),
    Case(4, 4, 16, 4, "all_dropped", "every pair dropped: no tiles"),
]


def _ids(case: Case, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + case.T * 31 + case.E)
    T, k, E = case.T, case.k, case.E
    if case.pattern == "one_expert":
        return torch.full((T, k), 7, dtype=torch.int32)
    if case.pattern == "same_experts":
        return torch.tensor([[5, 1, 6, 2]], dtype=torch.int32).expand(T, k).contiguous()
    if case.pattern == "all_dropped":
        return torch.full((T, k), -1, dtype=torch.int32)
    if case.pattern == "skewed":  # Zipf-like: low expert ids far more popular
        w = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
        return torch.stack([torch.multinomial(w, k, generator=g) for _ in range(T)]).to(torch.int32)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    if case.pattern == "oea_dropped":
        ids[::2, 5:] = -1
        ids[1::3, 7] = -1
    return ids


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c.T}_k{c.k}_E{c.E}_m{c.block_m}_{c.pattern}")
def test_dispatch_matches_reference(case, config, device):
    ids = _ids(case).to(device)
    ref = dispatch_reference(ids, case.E, case.block_m)
    check_invariants(ids, case.E, case.block_m, ref)
    out = dispatch(ids, case.E, case.block_m, config=CONFIGS[config])
    assert_same_plan(out, ref)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c.T}_k{c.k}_E{c.E}_m{c.block_m}_{c.pattern}")
def test_block_chain_with_and_without_the_place_kernel(case, device):
    """The block path places its pairs in one launch after the histograms where the blocks are few
    (``DispatchTuning.place_max_blocks``), else through scan, tiles and scatter: both give the
    reference's plan (with 16-pair blocks, T=33 x k=8 makes 17 blocks: the place kernel reads the
    histograms in two passes of ``DispatchTuning.place_block_b``)."""
    from fp4moe.ops import dispatch as dispatch_ops

    ids = _ids(case).to(device)
    ref = dispatch_reference(ids, case.E, case.block_m)
    assert dispatch_ops.uses_place_kernel(ids.numel(), BLOCKS.block_p)
    assert_same_plan(dispatch(ids, case.E, case.block_m, config=BLOCKS), ref)
    with tuning(dispatch=dict(place_max_blocks=0)):
        assert not dispatch_ops.uses_place_kernel(ids.numel(), BLOCKS.block_p)
        assert_same_plan(dispatch(ids, case.E, case.block_m, config=BLOCKS), ref)


def test_routing_output_feeds_dispatch(device):
    """OEA ids (with -1 slots) from the routing kernel, straight into dispatch."""
    from fp4moe.models import Routing
    from fp4moe.ops.routing import route

    logits = torch.randn(8, 32, device=device)
    logits[5:] = logits[4]  # tokens 4..7 are identical and share their 2 experts
    logits[:4] += torch.arange(32, device=device) * 10.0  # tokens 0..3 agree on experts 31 and 30
    ids = route(logits, Routing("softmax", top_k=6), k0=2).topk_ids
    assert bool((ids == -1).any())
    plan = dispatch(ids, 32, 4)
    check_invariants(ids, 32, 4, plan)
    assert_same_plan(plan, dispatch_reference(ids, 32, 4))


@pytest.mark.parametrize("block_m", [1, 7, 64])
def test_tile_map_for_another_block_m(block_m, device):
    """GEMM 2 may tile rows differently: the same plan re-tiled equals the reference's tiles."""
    for case in (CASES[0], CASES[3], CASES[6], CASES[9]):
        ids = _ids(case).to(device)
        plan = dispatch(ids, case.E, case.block_m)
        tiles = tile_map(plan, block_m)
        ref = tile_map_reference(plan.expert_counts.cpu(), plan.expert_offsets.cpu(), case.T * case.k, block_m)
        for name in TILE_FIELDS:
            assert torch.equal(getattr(tiles, name).cpu(), getattr(ref, name)), (case, name)
    empty = dispatch(torch.empty((0, 4), dtype=torch.int32, device=device), 16, 8)
    assert tile_map(empty, 4).tile_expert.shape == (0,) and int(tile_map(empty, 4).n_tiles) == 0


@pytest.mark.parametrize("block_m,rows", [(8, (0, 8)), (16, (8, 2**31 - 1)), (4, (2, 5)), (16, (0, 1))])
def test_class_tile_map_covers_its_experts_only(block_m, rows, device):
    """A class tile map (experts with lo < rows <= hi) equals the reference's, stays within its
    worst case, and the classes (0, h], (h, inf) together cover every routed row exactly once."""
    for case in (CASES[0], CASES[3], CASES[6], CASES[9]):
        ids = _ids(case).to(device)
        plan = dispatch(ids, case.E, case.block_m)
        tiles = tile_map(plan, block_m, rows)
        counts, offsets = plan.expert_counts.cpu(), plan.expert_offsets.cpu()
        ref = tile_map_reference(counts, offsets, case.T * case.k, block_m, rows)
        for name in TILE_FIELDS:
            assert torch.equal(getattr(tiles, name).cpu(), getattr(ref, name)), (case, name)
        assert tiles.tile_expert.shape[0] == max_tiles(case.T * case.k, case.E, block_m, rows)
        n = int(tiles.n_tiles)
        kept = counts[tiles.tile_expert[:n].long().cpu()]
        assert bool(((kept > rows[0]) & (kept <= rows[1])).all()), case
    for case in (CASES[0], CASES[3], CASES[4], CASES[6]):
        ids = _ids(case).to(device)
        plan = dispatch(ids, case.E, 16)
        covered = torch.zeros(ids.numel(), dtype=torch.int32)
        for bm, cls in ((8, (0, 8)), (16, (8, 2**31 - 1))):
            t = tile_map(plan, bm, cls)
            for s, e in zip(t.tile_start[:int(t.n_tiles)].tolist(), t.tile_end[:int(t.n_tiles)].tolist()):
                covered[s:e] += 1
        routed = int(plan.expert_offsets[-1])
        assert torch.equal(covered[:routed], torch.ones(routed, dtype=torch.int32)), case
    for bad in ((3, 3), (-1, 4), (1,), "0,8", (0.0, 8)):
        with pytest.raises(ValueError, match="rows"):
            tile_map(plan, 8, bad)


def test_tile_maps_shared_out_over_many_programs(device):
    """The tile-map kernel's programs take the experts' tile steps and the -1 entries in turn: with
    16 tiles per program, an expert of 40 tiles (block_m = 1) spans 3 programs' steps, and a map
    mostly of -1 entries spreads them over several programs."""
    with tuning(dispatch=dict(tiles_per_program=16)):
        for case in (CASES[3], CASES[0], CASES[7], CASES[9]):
            ids = _ids(case).to(device)
            ref = dispatch_reference(ids, case.E, case.block_m)
            plan = dispatch(ids, case.E, case.block_m, config=BLOCKS)
            assert_same_plan(plan, ref)
            for block_m, rows in ((1, None), (3, (0, 2)), (2, (2, 2**31 - 1))):
                tiles = tile_map(plan, block_m, rows)
                want = tile_map_reference(ref.expert_counts, ref.expert_offsets, case.T * case.k, block_m, rows)
                for name in TILE_FIELDS:
                    assert torch.equal(getattr(tiles, name).cpu(), getattr(want, name)), (case, block_m, rows, name)


@pytest.mark.parametrize("config", list(CONFIGS) + ["chain"])
def test_dispatch_writes_class_tile_maps(config, device):
    """``dispatch(classes=...)`` gives each class the map ``tile_map`` would: in the place kernel's
    launch for one or two classes, else a launch each (three classes, the one-program paths, the
    scan/tiles/scatter chain)."""
    cfg = BLOCKS if config == "chain" else CONFIGS[config]
    changes = dict(dispatch=dict(place_max_blocks=0)) if config == "chain" else {}
    with tuning(**changes):
        _check_class_tile_maps(cfg, device)


def _check_class_tile_maps(cfg, device) -> None:
    sets = (((8, (0, 8)), (16, (8, 2**31 - 1))), ((4, (2, 5)),), ((2, (0, 1)), (4, (1, 3)), (8, (3, 2**31 - 1))))
    for case in (CASES[0], CASES[3], CASES[6], CASES[9]):
        ids = _ids(case).to(device)
        ref = dispatch_reference(ids, case.E, case.block_m)
        for classes in sets:
            plan = dispatch(ids, case.E, case.block_m, config=cfg, classes=classes)
            assert_same_plan(plan, ref)
            assert len(plan.class_tiles) == len(classes)
            for (block_m, rows), got in zip(classes, plan.class_tiles):
                want = tile_map_reference(ref.expert_counts, ref.expert_offsets, case.T * case.k, block_m, rows)
                assert got.block_m == block_m and got.rows == rows
                for name in TILE_FIELDS:
                    assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), (case, classes, name)
    empty = dispatch(torch.empty((0, 4), dtype=torch.int32, device=device), 16, 8, classes=sets[0])
    assert [int(t.n_tiles) for t in empty.class_tiles] == [0, 0]
    ids = _ids(CASES[0]).to(device)
    for bad, err in (((8, (0, 8)), ValueError), ([(0, (0, 8))], ValueError), ([(8, (8, 8))], ValueError),
                     (8, TypeError)):
        with pytest.raises(err, match="classes|rows"):
            dispatch(ids, 256, 16, classes=bad)


def test_out_of_range_ids_are_dropped_or_rejected(device):
    ids = torch.tensor([[0, 3], [5, 1], [-7, 2]], dtype=torch.int32, device=device)  # 5 >= E, -7 < -1
    with pytest.raises(ValueError, match=r"topk_ids: expected ids in \[0, n_experts=4\) or -1 \(dropped\), "
                                         r"got 5 at token 1, slot 0"):
        dispatch(ids, 4, 2, check_ids=True)
    with pytest.raises(ValueError, match="topk_ids: expected ids in"):
        dispatch_reference(ids, 4, 2)
    clean = torch.where((ids >= 0) & (ids < 4), ids, torch.full_like(ids, -1))
    for cfg in (FUSED, BLOCKS):  # unchecked, the kernels drop them like -1
        assert_same_plan(dispatch(ids, 4, 2, config=cfg), dispatch_reference(clean, 4, 2))


def test_zero_tokens(device):
    ids = torch.empty((0, 8), dtype=torch.int32, device=device)
    plan = dispatch(ids, 256, 16)
    assert_same_plan(plan, dispatch_reference(ids, 256, 16))
    assert plan.expert_counts.shape == (256,) and int(plan.expert_counts.sum()) == 0
    assert plan.tiles.tile_expert.shape == (0,) and int(plan.tiles.n_tiles) == 0


def test_determinism(device):
    case = CASES[0]
    ids = _ids(case, seed=3).to(device)
    for cfg in (FUSED, BLOCKS):
        a, b = dispatch(ids, case.E, case.block_m, config=cfg), dispatch(ids, case.E, case.block_m, config=cfg)
        assert_same_plan(a, b)


def test_block_sizes_do_not_change_the_plan(device):
    case = CASES[6]
    ids = _ids(case, seed=4).to(device)
    ref = dispatch_reference(ids, case.E, case.block_m)
    for cfg in (DispatchConfig(32, True, 8), DispatchConfig(64, False, 4), DispatchConfig(256, False, 8)):
        assert_same_plan(dispatch(ids, case.E, case.block_m, config=cfg), ref)


def test_bad_inputs(device):
    ids = torch.zeros((4, 2), dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="topk_ids: expected int32 \\(routing's output\\), got torch.int64"):
        dispatch(ids.long(), 8, 16)
    with pytest.raises(ValueError, match=r"topk_ids: expected a 2-D tensor \[T, k\], got shape \(8,\)"):
        dispatch(ids.flatten(), 8, 16)
    with pytest.raises(ValueError, match="topk_ids: expected 1..n_experts=1 columns \\(top-k\\), got 2"):
        dispatch(ids, 1, 16)
    with pytest.raises(ValueError, match="n_experts: expected an int in 1..4095, got 0"):
        dispatch(ids, 0, 16)
    with pytest.raises(ValueError, match="block_m: expected a positive int, got 0"):
        dispatch(ids, 8, 0)
    with pytest.raises(ValueError, match="DispatchConfig.block_p"):
        DispatchConfig(24, True, 4)


def test_max_tiles_bound():
    assert max_tiles(32768, 256, 64) == 512 + 256
    assert max_tiles(8, 256, 16) == 8  # never more tiles than pairs
    assert max_tiles(0, 256, 16) == 0


def test_heuristic():
    """One program with every pair in one vector up to 64 pairs, ~32 pairs per block above (the
    H200 sweeps)."""
    assert DispatchConfig.from_heuristic(8, 256) == DispatchConfig(16, True, 4)  # decode: one launch
    assert DispatchConfig.from_heuristic(32, 128) == DispatchConfig(32, True, 4)
    assert DispatchConfig.from_heuristic(32, 256) == DispatchConfig(32, True, 4)
    assert DispatchConfig.from_heuristic(64, 256) == DispatchConfig(64, True, 8)
    assert DispatchConfig.from_heuristic(65, 256) == DispatchConfig(16, False, 4)
    assert DispatchConfig.from_heuristic(128, 256) == DispatchConfig(16, False, 4)
    assert DispatchConfig.from_heuristic(16, 1024) == DispatchConfig(16, True, 8)
    assert DispatchConfig.from_heuristic(16, 2048) == DispatchConfig(16, False, 4)  # 32K comparisons
    assert DispatchConfig.from_heuristic(2048, 256) == DispatchConfig(64, False, 4)
    assert DispatchConfig.from_heuristic(32768, 256) == DispatchConfig(128, False, 4)


# ------------------------------------------------------------------------------ cross-compilation


@pytest.mark.slow  # cross-compilation or many interpreter runs: .ci/run runs it
def test_cross_compile_default_configs():
    """Both paths' heuristic configurations compile for SM80, SM90 and SM120 without spilling."""
    from fp4moe.ops.dispatch import compile_requests
    from fp4moe.plan.crosscompile import cross_compile

    requests = []
    # one vector (up to 64 x 256 and 16 x 1024 comparisons), blocks
    for n_pairs, E in ((16, 256), (32, 160), (64, 256), (16, 1024), (32768, 256), (512, 256)):
        cfg = DispatchConfig.from_heuristic(n_pairs, E)
        for cc in (80, 90, 120):
            requests += compile_requests(n_pairs, E, 8, 64, cfg, cc)
    # the place kernel with the decode path's two class maps (GLM-5 at 256 tokens)
    heights = ((8, (0, 8)), (16, (8, 2**31 - 1)))
    for cc in (80, 90, 120):
        requests += compile_requests(2048, 256, 8, 16, DispatchConfig.from_heuristic(2048, 256), cc, classes=heights)
    assert any(r.constexprs.get("N_CLASSES") == 2 for r in requests)
    for req, r in zip(requests, cross_compile(requests)):
        assert r.ok, f"sm{req.cc} {req.kernel} {req.constexprs}: {r.error}"
        assert r.spill_bytes == 0, f"sm{req.cc} {req.kernel} {req.constexprs}: spills {r.spill_bytes} B"


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["random", "skewed", "one_expert", "oea_dropped"])
@pytest.mark.parametrize("T", [1, 16, 64, 4096, 16384])
def test_gpu_glm5_sizes(T, pattern):
    case = Case(T, 8, 256, 64, pattern, "GLM-5 top-8")
    ids = _ids(case).cuda()
    ref = dispatch_reference(ids, 256, 64)
    for cfg in (None, DispatchConfig(32, True, 8), DispatchConfig(128, False, 4)):
        assert_same_plan(dispatch(ids, 256, 64, config=cfg), ref)
    if T <= 64:
        check_invariants(ids, 256, 64, ref)
