"""The Hopper prefill kernel (kernels/gemm_wgmma.py): configuration and launcher checks and the
SM90 cross-compilation on CPU; the kernel itself, the linear routing and the MoE layer on the GPU."""

from dataclasses import replace

import pytest
import torch

from fp4moe.ops.wgmma import WGMMA_MIN_M, WgmmaConfig, _x_pairs, choose_wgmma_config
from fp4moe.quantize import quantize
from layer_checks import (FMTS, check_fp4linear_graph, check_moe_layer, check_packed_linear, moe_variants,
                          run_compile_snippet)


def test_config_validation_and_choice():
    assert str(WgmmaConfig()) == "wgmma_n128_m128_s4_g8"
    with pytest.raises(ValueError, match="block_m"):
        WgmmaConfig(block_m=48)
    with pytest.raises(ValueError, match="stages"):
        WgmmaConfig(stages=2)
    with pytest.raises(ValueError, match="warps"):
        WgmmaConfig(warps=2)
    with pytest.raises(ValueError, match="repeats"):
        WgmmaConfig(repeats=3)
    with pytest.raises(ValueError, match="accumulator registers"):
        WgmmaConfig(block_m=256)  # two repeats x 256 columns: 256 fp32 registers per thread
    wide = WgmmaConfig(block_m=256, warps=8, repeats=1)
    assert (wide.block_n, str(wide)) == (128, "wgmma_n128_m256_s4_g8_r1")
    assert WgmmaConfig().block_n == 128 and WgmmaConfig(warps=8).block_n == 256
    assert str(WgmmaConfig(tail_m=64)) == "wgmma_n128_m128_s4_g8_t64"
    merged = WgmmaConfig(tail_m=32, merge_tail=True)
    assert str(merged) == "wgmma_n128_m128_s4_g8_t32_mt" and WgmmaConfig.parse(str(merged)) == merged
    with pytest.raises(ValueError, match="merge_tail.*needs tail_m"):
        WgmmaConfig(merge_tail=True)
    assert merged.with_tail(0) == WgmmaConfig() and merged.with_tail(32, block_m=64) == replace(merged, block_m=64)
    for bad in (48, 128):  # not a tile height, or not below block_m
        with pytest.raises(ValueError, match="tail_m"):
            WgmmaConfig(tail_m=bad)
    wide = dict(stages=4, group_m=8, warps=8, repeats=1)
    assert choose_wgmma_config(4096, 12288, 6144) == WgmmaConfig(block_m=256, persistent=True, **wide)
    assert str(choose_wgmma_config(4096, 12288, 6144)) == "wgmma_n128_m256_s4_g8_r1_p"
    assert WgmmaConfig.parse("wgmma_n128_m256_s4_g8_r1_p") == choose_wgmma_config(4096, 12288, 6144)
    assert not choose_wgmma_config(512, 12288, 6144).persistent  # 128-row tiles: two programs per SM
    for bad in (dict(warps=4, repeats=1), dict(warps=8, repeats=1, split_k=2), dict(warps=8, repeats=1, ws=True),
                dict(warps=8, repeats=1, tail_m=64), dict(warps=8, repeats=1, block_m=128)):
        with pytest.raises(ValueError, match="persistent"):
            WgmmaConfig(persistent=True, **{"block_m": 256, **bad})
    assert not choose_wgmma_config(4096, 12288, 64).persistent  # one K chunk: a refill would reach two tiles on
    # the fewest waves x rows, on 132 SMs (what the H200 sweep measured fastest at each point)
    assert choose_wgmma_config(96, 4096, 6144).block_m == 64  # one wave either way: fewest rows
    assert choose_wgmma_config(256, 6144, 12288).block_m == 128  # 96 programs: one wave of 128 rows
    assert choose_wgmma_config(512, 12288, 6144).block_m == 128  # 3 waves x 128 < 2 waves x 256
    assert choose_wgmma_config(1024, 12288, 6144).block_m == 256  # 6 x 128 = 3 x 256: the taller tile
    assert choose_wgmma_config(1024, 6144, 2048).block_m == 128
    assert choose_wgmma_config(1024, 6144, 2048, sm_count=200).block_m == 256  # fewer SMs, other waves
    assert WGMMA_MIN_M > 16  # decode sizes stay on the mma.sync kernel
    # small batches: 32/64-row tiles of one warpgroup, K split over up to 3 programs per SM, >= 8 chunks each
    small = dict(stages=4, warps=4, repeats=2)
    assert choose_wgmma_config(17, 12288, 6144) == WgmmaConfig(block_m=32, split_k=4, **small)  # 96 x 4 <= 396
    assert choose_wgmma_config(64, 6144, 12288) == WgmmaConfig(block_m=64, split_k=8, **small)
    assert choose_wgmma_config(64, 6144, 2048).split_k == 4  # 32 chunks: 8 per split
    assert choose_wgmma_config(64, 6144, 256).split_k == 1  # 4 chunks: too few to split
    assert choose_wgmma_config(40, 12288, 6144, sm_count=32).split_k == 1  # 96 tiles already fill 32 SMs
    assert str(WgmmaConfig(block_m=32, split_k=4)) == "wgmma_n128_m32_s4_g8_split4"
    for bad in (dict(split_k=0), dict(split_k=65), dict(split_k=2, tail_m=64),
                dict(split_k=2, warps=8, repeats=1, block_m=256, ws=True)):
        with pytest.raises(ValueError, match="split_k"):
            WgmmaConfig(**bad)
    ws = WgmmaConfig(block_m=256, warps=8, repeats=1, ws=True)
    assert str(ws) == "wgmma_n128_m256_s4_g8_r1_ws" and not choose_wgmma_config(4096, 12288, 6144).ws
    for bad in (dict(warps=4, repeats=1), dict(warps=8, repeats=2), dict(warps=8, repeats=1, stages=2),
                dict(warps=8, repeats=1, block_m=128, tail_m=64)):
        with pytest.raises(ValueError, match="ws|stages"):
            WgmmaConfig(ws=True, **bad)


def test_moe_config_choice():
    from fp4moe.ops.mma_sync import MMAConfig
    from fp4moe.ops.moe import mma_moe_config, wgmma_moe_config

    from fp4moe.target import get_arch
    from fp4moe.ops.moe import packed_moe_kernel
    from fp4moe.tuning import MoETuning

    assert mma_moe_config(3.0) == MMAConfig(rb=1, warps=4, kh=4, block_m=8, split_k=1)
    # past 4 rows per expert: 16-row tiles, two row blocks per warp share each x fragment
    assert mma_moe_config(8.0) == MMAConfig(rb=2, warps=4, kh=2, block_m=16, split_k=1)
    # few token-expert pairs (the experts' count given): K split in two, then two-warp programs
    assert MoETuning().few_pairs == (8, 16)
    assert mma_moe_config(8 / 256, 256) == MMAConfig(rb=1, warps=4, kh=2, block_m=8, split_k=2)
    assert mma_moe_config(16 / 256, 256) == MMAConfig(rb=1, warps=2, kh=4, block_m=8, split_k=1)
    assert mma_moe_config(24 / 256, 256) == mma_moe_config(24 / 256) == mma_moe_config(3.0)
    assert mma_moe_config(8.0, 256) == mma_moe_config(8.0)
    # GEMM 2 of the K-split few-pairs configuration: two row blocks per warp; every other one as GEMM 1's
    from fp4moe.ops.moe import mma_moe_gemm2_config

    assert mma_moe_gemm2_config(mma_moe_config(8 / 256, 256)) == MMAConfig(rb=2, warps=4, kh=2, block_m=8, split_k=2)
    for rows in (16 / 256, 3.0, 8.0):
        assert mma_moe_gemm2_config(mma_moe_config(rows, 256)) == mma_moe_config(rows, 256)
    # GEMM 2 of MMAHeights' short-tile class: 128 weight rows per program; the tall class as GEMM 1's
    from fp4moe.ops.moe import MMAHeights, mma_moe_layer_config

    heights = mma_moe_layer_config(8.0, 256)
    assert isinstance(heights, MMAHeights)
    (small, low), (large, high) = heights.classes()
    assert mma_moe_gemm2_config(small, low) == MMAConfig(rb=2, warps=4, kh=4, block_m=8, split_k=1) != small
    assert mma_moe_gemm2_config(large, high) == large
    # GEMM 2's pair rows: bf16 for bf16 outputs where K is not split, else fp32
    from fp4moe.ops import moe as moe_ops

    assert MoETuning().pair_rows == "bf16"
    assert moe_ops.mma_pair_rows(mma_moe_config(8.0), 32, "bf16") == "bf16"
    assert moe_ops.mma_pair_rows(mma_moe_config(8.0), 32, "fp16") == "fp32"
    assert moe_ops.mma_pair_rows(mma_moe_gemm2_config(mma_moe_config(8 / 256, 256)), 32, "bf16") == "fp32"
    assert wgmma_moe_config(16.0).block_m == 32
    assert wgmma_moe_config(32.0).block_m == 64
    assert wgmma_moe_config(127.9) == WgmmaConfig(block_m=128, stages=4, warps=4, tail_m=32)
    assert wgmma_moe_config(512.0) == WgmmaConfig(block_m=128, stages=4, warps=4, tail_m=32)
    for merged in (128.0, 144.0, 160.0):  # a full tile and a short one per expert: merged
        assert wgmma_moe_config(merged) == WgmmaConfig(block_m=128, stages=4, warps=4, tail_m=32, merge_tail=True)
    assert not wgmma_moe_config(160.1).merge_tail
    sm80, sm90 = get_arch("sm80"), get_arch("sm90")
    assert packed_moe_kernel(sm90, MoETuning().wgmma_min_rows, 4096, 6144, False) == "mma"
    assert packed_moe_kernel(sm90, 16.0, 4096, 6144, False) == "wgmma"
    assert packed_moe_kernel(sm90, 16.0, 4096, 6144, True) == "mma"  # interleaved gate/up: not on wgmma
    assert packed_moe_kernel(sm80, 16.0, 4096, 6144, False) == "mma"  # no wgmma: decode kernel to MAX_M
    assert packed_moe_kernel(sm80, 17.0, 4096, 6144, False) is None
    assert packed_moe_kernel(sm90, 1.0, 4096, 6136, False) is None  # rows not whole 16-row blocks


def test_moe_decode_heights_choice():
    """Experts averaging 4-8 rows: the 8-row configuration for the experts of at most 8 rows and the
    16-row one for the others, two launches per GEMM (``MMAHeights``); elsewhere one configuration."""
    from fp4moe.ops.dispatch import ALL_ROWS
    from fp4moe.ops.mma_sync import MMAConfig
    from fp4moe.ops.moe import MMAHeights, mma_moe_config, mma_moe_layer_config
    from fp4moe.tuning import MoETuning

    tune = MoETuning()
    small, large = mma_moe_config(1.0), mma_moe_config(8.0)
    tall = replace(large, xs=tune.heights_x_stages)  # the tall class reads x through the shared-memory ring
    assert (small.xs, large.xs, tune.heights_x_stages) == (0, 0, 2)
    for rows in (4.1, 6.0, float(tune.heights_rows)):
        cfg = mma_moe_layer_config(rows)
        assert cfg == MMAHeights(small, tall, 8) and cfg.block_m == 16 and cfg.split_k == 1
        assert cfg.classes() == ((small, (0, 8)), (tall, (8, ALL_ROWS)))
        assert str(cfg) == "mma_n64_m8_k256_w4+mma_n128_m16_k128_w4_xs2@8"
    assert mma_moe_layer_config(1.0) == small and mma_moe_layer_config(4.0) == small
    assert mma_moe_layer_config(tune.heights_rows + 0.1) == large  # (SM80 up to MAX_M rows)
    with pytest.raises(ValueError, match="shorter"):
        MMAHeights(large, small, 8)
    with pytest.raises(ValueError, match="split_k"):
        MMAHeights(small, MMAConfig(rb=2, warps=4, kh=2, block_m=16, split_k=2), 8)
    with pytest.raises(ValueError, match="rows"):
        MMAHeights(small, large, 0)
    with pytest.raises(TypeError, match="MMAConfig"):
        MMAHeights(small, "mma_n128_m16_k128_w4", 8)


def test_guard_probe_runs_both_tile_heights():
    """The guard's MoE probe for a configuration with tail_m gives one expert more rows than tail_m
    (GEMM 1's tall variant) and the others fewer (its tail variant), top-k ids distinct per token,
    the dropped slot kept; without it, the small probe of before."""
    from fp4moe.ops.moe import _probe_problem

    p = _probe_problem(72, "nvfp4", device="cpu", dtype=torch.bfloat16, per_row=False, bias=False, hot_rows=64)
    ids = p.topk_ids
    counts = torch.bincount(ids[ids >= 0].long(), minlength=5)
    assert counts[0] == 72 > 64 and 0 < counts[1:].max() <= 64
    assert (ids[:, 0] != ids[:, 1]).all() and int((ids < 0).sum()) == 1
    merged = _probe_problem(136, "nvfp4", device="cpu", dtype=torch.bfloat16, per_row=False, bias=False, hot_rows=32,
                            split=40).topk_ids  # as _probe builds it for WgmmaConfig(tail_m=32, merge_tail=True)
    counts = torch.bincount(merged[merged >= 0].long(), minlength=5).tolist()
    assert counts[0] == 136 and 32 < counts[1] < 128 and max(counts[2:]) <= 32  # merged, full alone, tails alone
    small = _probe_problem(7, "nvfp4", device="cpu", dtype=torch.bfloat16, per_row=False, bias=False)
    assert small.topk_ids.shape == (7, 2) and bool((small.topk_ids < 5).all())
    # the probe's rows for each kind of configuration, as _probe asks for them
    from fp4moe.ops.moe import _probe_rows, mma_moe_config, mma_moe_layer_config, wgmma_moe_config

    assert _probe_rows(mma_moe_config(1.0)) == (7, 0, 0)
    assert _probe_rows(wgmma_moe_config(512.0)) == (40, 32, 0)
    assert _probe_rows(wgmma_moe_config(128.0)) == (136, 32, 40)
    heights = mma_moe_layer_config(8.0)
    T, hot, split = _probe_rows(heights)
    ids = _probe_problem(T, "nvfp4", device="cpu", dtype=torch.bfloat16, per_row=False, bias=False, hot_rows=hot,
                         split=split).topk_ids
    counts = torch.bincount(ids[ids >= 0].long(), minlength=5).tolist()
    # expert 0 on two large tiles, every other expert in the small class
    assert counts[0] == T > heights.large.block_m and 0 < max(counts[1:]) <= heights.rows, counts


def test_activation_pairs_checks():
    with pytest.raises(TypeError, match="bfloat16"):
        _x_pairs(torch.zeros(4, 64, dtype=torch.float16))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert _x_pairs(x[:, :32]).shape == (3, 16)  # strided rows: pairs view (a copy only if needed)
    assert torch.equal(_x_pairs(x).view(torch.bfloat16), x)


def _mma_order_reference(x: torch.Tensor, k_stored: int) -> torch.Tensor:
    """MMA position 16kl + 8i2 + 2t + i0 of each 64-K chunk holds stored k = 16t + 4kl + 2i2 + i0."""
    xp = torch.nn.functional.pad(x, (0, k_stored - x.shape[1]))
    v = xp.reshape(x.shape[0], k_stored // 64, 4, 4, 2, 2)  # [m, c, t, kl, i2, i0]
    return v.permute(0, 1, 3, 4, 2, 5).reshape(x.shape[0], k_stored)


@pytest.mark.parametrize("M,K,k_stored,gather", [(5, 64, 64, False), (17, 96, 128, False), (33, 512, 512, True),
                                                  (3, 16, 64, True), (20, 1024, 1024, False)])
def test_mma_order_rows_matches_the_weight_permutation(M, K, k_stored, gather):
    """The activation pass (interpreter) equals the reference permutation, which
    ``test_mma_order_is_the_pack_order`` ties to the packed weights; gathered rows of -1 are zero."""
    from fp4moe.ops.wgmma import mma_order_rows

    torch.manual_seed(M)
    x = torch.randn(M, K, dtype=torch.bfloat16)
    rows = torch.randint(-1, M, (2 * M + 1,), dtype=torch.int32) if gather else None  # -1: a dropped pair
    out = mma_order_rows(x, k_stored, rows)
    src = torch.cat([x, torch.zeros_like(x[:1])])[rows.long()] if gather else x
    assert torch.equal(out, _mma_order_reference(src, k_stored))
    with pytest.raises(ValueError, match="multiple of 64"):
        mma_order_rows(x, k_stored + 32)


def test_wgmma_launchers_check_their_buffers():
    """Bad buffers are refused before anything launches (CPU: the checks run first)."""
    from fp4moe.ops.dispatch import dispatch
    from fp4moe.ops.mma_pack import pack_mma
    from fp4moe.ops.mma_requests import wgmma_compile_request
    from fp4moe.ops.wgmma import _x_desc, launch_grouped_wgmma, launch_linear_wgmma, mma_order_rows
    from fp4moe.ops.moe import mma_packed_experts, random_moe_problem

    persistent = WgmmaConfig(block_m=256, warps=8, repeats=1, persistent=True)
    with pytest.raises(ValueError, match="max_programs"):
        launch_linear_wgmma(torch.randn(4, 128, dtype=torch.bfloat16), pack_mma(quantize(torch.randn(32, 128))), None,
                            torch.empty(4, 32, dtype=torch.bfloat16), persistent, max_programs=0)
    for gemm in ("gemm1", "gemm2"):
        with pytest.raises(ValueError, match="persistent is for the plain linear"):
            wgmma_compile_request(persistent, "nvfp4", 90, gemm=gemm)

    x = torch.randn(8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows: expected a 1-D int32/int64"):
        mma_order_rows(x, 128, torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="out: expected a contiguous bf16"):
        mma_order_rows(x, 128, out=torch.empty(8, 64, dtype=torch.bfloat16))
    odd = torch.randn(4, 128, dtype=torch.bfloat16)[:, 1:65]  # misaligned base, K 64
    with pytest.raises(ValueError, match="activations for TMA"):
        _x_desc(odd, 64)
    assert torch.equal(mma_order_rows(x, 128, torch.arange(8, dtype=torch.int64).flip(0)[::2]),
                       _mma_order_reference(x.flip(0)[::2], 128))  # strided rows are made contiguous

    prob = random_moe_problem(40, 4, 2, 128, 96, "nvfp4", device="cpu", seed=0)
    plan = dispatch(prob.topk_ids, 4, 64)
    p13 = mma_packed_experts(prob.w13)
    cfg = WgmmaConfig(block_m=64)
    R = plan.sorted_pair.shape[0]
    h_short = torch.zeros(R, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="MMA K order writes"):
        launch_grouped_wgmma(prob.x, p13, 192, plan, h_short, cfg, gather=True, out_mma_order=True, swiglu=1)
    with pytest.raises(ValueError, match="only GEMM 1"):
        launch_grouped_wgmma(prob.x, p13, 192, plan, torch.zeros(R, 128), cfg, gather=True, out_mma_order=True)
    with pytest.raises(ValueError, match="not gathered again"):
        launch_grouped_wgmma(prob.x, p13, 192, plan, h_short, cfg, gather=True, x_mma_order=True, swiglu=1)
    with pytest.raises(ValueError, match="neither split K over programs nor run persistent"):
        launch_grouped_wgmma(prob.x, p13, 192, dispatch(prob.topk_ids, 4, 256), torch.zeros(R, 128), persistent,
                             gather=True)
    with pytest.raises(ValueError, match="needs repeats=2"):
        launch_grouped_wgmma(prob.x, p13, 192, plan, h_short, WgmmaConfig(block_m=64, repeats=1), gather=True,
                             out_mma_order=True, swiglu=1)


def test_mma_order_is_the_pack_order():
    """``_mma_order_reference`` (what ``mma_order_rows`` is tested against) is the order in which the
    packed weights reach the MMA: reading the packed words as the A fragments (lane 4g + t, word kl,
    value 4 i0 + 2 i2 + i1 -> row 8 i1 + g, MMA position 16 kl + 8 i2 + 2t + i0) gives the weight
    codes in exactly that order."""
    from fp4moe.formats import unpack_fp4
    from fp4moe.ops.mma_pack import pack_mma, word_codes

    torch.manual_seed(1)
    w = quantize(torch.randn(32, 192), "nvfp4")
    p = pack_mma(w)
    nib = word_codes(p.words)  # [rb, kc, lane, kl, p]
    nib = nib.reshape(2, 3, 8, 4, 4, 2, 2, 2)  # [rb, kc, g, t, kl, i0, i2, i1]
    a = nib.permute(0, 7, 2, 1, 4, 6, 3, 5).reshape(32, 192)  # [rb, i1, g | kc, kl, i2, t, i0]
    assert torch.equal(a, _mma_order_reference(unpack_fp4(w.data).to(torch.int64), 192))


_COMPILE = r"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from fp4moe.kernels import gemm_wgmma as G
from fp4moe.ops.mma_requests import wgmma_compile_request
from fp4moe.ops.wgmma import WgmmaConfig
from fp4moe.plan.crosscompile import mma_instructions
from fp4moe.plan.sass import count_hgmma, loop_local_memory_ops, wgmma_register_hazards
from fp4moe.plan.worker import sass_of_ptx
out = []
fn = G.fp4_gemm_wgmma_kernel
for gemm, warps, bm, stages, fmt, bias, repeats, tail, split, persistent, merge in json.loads(sys.argv[1]):
    req = wgmma_compile_request(WgmmaConfig(block_m=bm, stages=stages, warps=warps, repeats=repeats, tail_m=tail,
                                            split_k=split, persistent=persistent, merge_tail=merge), fmt, 90,
                                gemm=gemm, has_bias=bias)
    sig = dict(req.signature, **{k: "constexpr" for k in req.constexprs})
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in req.divisible_by_16}
    c = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=req.constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptx = c.asm["ptx"]
    sass = sass_of_ptx(ptx, 90)
    out.append({"case": [gemm, warps, bm, stages, fmt, bias, repeats, tail, split, persistent, merge],
                "shared": c.metadata.shared, "mma": mma_instructions(ptx),
                "local": sass.count("STL") + sass.count("LDL"), "loop_local": loop_local_memory_ops(sass),
                "decode": ptx.count("fma.rn.bf16x2"), "cp_async": ptx.count("cp.async.ca.shared.global") + ptx.count("cp.async.cg.shared.global"),
                "tma": ptx.count("cp.async.bulk.tensor"), "mbarrier_wait": ptx.count("mbarrier.try_wait"),
                "hgmma": count_hgmma(sass), "hazards": wgmma_register_hazards(sass),
                "pdl_waits": ptx.count("griddepcontrol.wait"),
                "tma_before_wait": ptx.split("griddepcontrol.wait")[0].count("cp.async.bulk.tensor"),
                "expect_before_wait": ptx.split("griddepcontrol.wait")[0].count("mbarrier.arrive.expect_tx")})
print(json.dumps(out))
"""

_SASS_LOOP = """
        /*0100*/                   LDS.128 R152, [R13+UR5+0x10000] ;
        /*0110*/                   HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR8], R88 ;
        /*0120*/                   HGMMA.64x128x16.F32.BF16 R88, R156, gdesc[UR4], R88, gsb0 ;
        /*0130*/                   WARPGROUP.DEPBAR.LE gsb0, 0x%d ;
        /*0140*/                   IMAD R12, R13, 0x2, RZ ;
        /*0150*/               @P0 BRA 0x100 ;
        /*0160*/                   %s ;
        /*0170*/                   EXIT ;
"""


def test_wgmma_register_hazard_check():
    """The SASS check follows the control flow: it flags the load into R152 while the previous
    iteration's wgmma (A = R152) is still in flight (the wait leaves one group), a write to an
    in-flight A register after the loop, and a read of an in-flight accumulator; nothing once the
    wait retires every group."""
    from fp4moe.plan.sass import count_hgmma, wgmma_register_hazards

    assert wgmma_register_hazards(_SASS_LOOP % (1, "NOP")) == [("0x100", "LDS.128", "R152")]
    after = wgmma_register_hazards(_SASS_LOOP % (1, "IMAD R157, R13, 0x2, RZ"))
    assert ("0x160", "IMAD", "R157") in after
    assert ("0x160", "FADD", "R90") in wgmma_register_hazards(_SASS_LOOP % (1, "FADD R12, R90, R13"))
    assert wgmma_register_hazards(_SASS_LOOP % (0, "FADD R157, R90, R13")) == []
    assert count_hgmma(_SASS_LOOP % (0, "NOP")) == 2


def test_loop_spill_count():
    """wgmma kernels: spill stores and loads count when they sit inside a loop whose body holds an
    HGMMA (the backward branch's range, also before the first HGMMA of the body), not after it (an
    epilogue's); without a branch, between the first and last HGMMA. Other kernels: all of them
    when there is any backward branch, none without one (a branch to itself is not a loop)."""
    from fp4moe.plan.sass import loop_local_memory_ops

    epilogue = _SASS_LOOP % (0, "STL.64 [R1], R2")
    assert loop_local_memory_ops(epilogue) == 0
    inside = epilogue.replace("IMAD R12, R13, 0x2, RZ", "LDL.LU.64 R2, [R1]").replace(
        "HGMMA.64x128x16.F32.BF16 R88, R156, gdesc[UR4], R88, gsb0 ;", "STL [R1+0x8], R5 ;\n        /*0124*/ "
        "HGMMA.64x128x16.F32.BF16 R88, R156, gdesc[UR4], R88, gsb0 ;")
    assert loop_local_memory_ops(inside) == 2  # the STL between the HGMMAs, the LDL before the branch
    reload = epilogue.replace("LDS.128 R152, [R13+UR5+0x10000]", "LDL.128 R152, [R1+0x10]")
    assert loop_local_memory_ops(reload) == 1  # in the body, before its first HGMMA
    straight = "\n".join(line for line in inside.splitlines() if "BRA" not in line)
    assert loop_local_memory_ops(straight) == 1  # no loop: the first-to-last HGMMA range
    assert loop_local_memory_ops("        /*0000*/ STL [R1], R2 ;\n") == 0
    plain_loop = "\n".join(line for line in epilogue.splitlines() if "HGMMA" not in line)
    assert loop_local_memory_ops(plain_loop) == 1  # a loop: the spill after it counts too
    loop_free = ("        /*0000*/ STL [R1], R2 ;\n        /*0010*/ @P0 BRA 0x30 ;\n        /*0020*/ LDL R2, [R1] ;\n"
                 "        /*0030*/ EXIT ;\n        /*0040*/ BRA 0x40 ;\n")
    assert loop_local_memory_ops(loop_free) == 0  # forward branch and the closing branch-to-self only
    assert loop_local_memory_ops(loop_free.replace("BRA 0x30", "BRA 0x0")) == 2


# the configurations the runtime picks (choose_wgmma_config, wgmma_moe_config), the GPU tests' and
# the rest of the shape space (two warpgroups, 3- and 6-deep rings, MXFP4), compiled as launched
# (gemm, warps, block_m, stages, fmt, bias, repeats, tail_m, split_k, persistent, merge_tail)
WGMMA_CASES = [c + (1, False, False) for c in [
    ("linear", 4, 128, 4, "nvfp4", True, 2, 0), ("linear", 4, 64, 4, "nvfp4", False, 2, 0),
    ("linear", 4, 64, 3, "mxfp4", True, 2, 0), ("linear", 8, 128, 6, "nvfp4", True, 2, 0),
    ("linear", 8, 128, 4, "mxfp4", False, 2, 0), ("linear", 8, 256, 4, "nvfp4", True, 1, 0),
    ("linear", 4, 256, 3, "mxfp4", False, 1, 0), ("gemm1", 4, 64, 4, "nvfp4", False, 2, 0),
    ("gemm1", 4, 128, 4, "mxfp4", True, 2, 64), ("gemm1", 8, 128, 4, "nvfp4", True, 2, 0),
    ("gemm1", 4, 128, 4, "nvfp4", False, 2, 64), ("gemm2", 4, 128, 4, "nvfp4", False, 2, 64),
    ("gemm2", 4, 64, 4, "mxfp4", True, 2, 0), ("gemm2", 4, 128, 3, "nvfp4", True, 2, 0),
    ("gemm2", 8, 128, 4, "nvfp4", False, 1, 0), ("gemm2", 8, 256, 4, "mxfp4", False, 1, 128),
    ("gemm1", 4, 32, 4, "nvfp4", False, 2, 0), ("gemm2", 4, 32, 4, "mxfp4", True, 2, 0),
    ("gemm1", 4, 16, 6, "mxfp4", False, 2, 0), ("gemm2", 8, 16, 4, "nvfp4", False, 2, 0),
    ("gemm1", 4, 128, 4, "nvfp4", False, 2, 32), ("gemm2", 4, 128, 4, "mxfp4", True, 2, 32)]] + [
    # small batches: K split over programs (fp32 partials, bias in the reduction)
    ("linear", 4, 32, 4, "nvfp4", True, 2, 0, 4, False, False),
    ("linear", 4, 64, 4, "mxfp4", False, 2, 0, 8, False, False),
    ("linear", 8, 16, 6, "nvfp4", False, 1, 0, 2, False, False),
    # persistent programs (the prefill's 256-row tiles): no spills either
    ("linear", 8, 256, 4, "nvfp4", True, 1, 0, 1, True, False),
    ("linear", 8, 256, 3, "mxfp4", False, 1, 0, 1, True, False),
    # merged tails (two accumulators): spills outside the K loop only
    ("gemm1", 4, 128, 4, "nvfp4", False, 2, 32, 1, False, True),
    ("gemm2", 4, 128, 4, "nvfp4", False, 2, 32, 1, False, True),
    ("gemm1", 4, 128, 4, "mxfp4", True, 2, 32, 1, False, True),
    ("gemm2", 4, 128, 4, "mxfp4", True, 2, 32, 1, False, True)]


@pytest.mark.slow  # cross-compilation or many interpreter runs: .ci/run runs it
def test_cross_compiles_for_sm90():
    """Plain linear and both MoE GEMMs compile for SM90 with wgmma (A from the decoded registers),
    activations and weight words by TMA on mbarriers (no cp.async), inside the per-block
    shared-memory limit and exactly as the model (``wgmma_smem_terms``) says, and their SASS leaves
    in-flight wgmma registers alone; split-K launches request their first weights before their PDL wait."""
    from fp4moe.target import get_arch
    from fp4moe.ops.wgmma import wgmma_smem_terms

    results = run_compile_snippet(_COMPILE, WGMMA_CASES, timeout=1800)
    limit = get_arch("sm90").smem_per_block_optin
    assert len(results) == len(WGMMA_CASES)
    for r in results:
        gemm, warps, bm, stages, fmt, bias, repeats, tail, split, persistent, merge = r["case"]
        cfg = WgmmaConfig(block_m=bm, stages=stages, warps=warps, repeats=repeats, tail_m=tail, split_k=split,
                          persistent=persistent, merge_tail=merge)
        model = sum(each * count for _, each, count in wgmma_smem_terms(cfg, fmt))
        assert r["shared"] == model and r["shared"] <= limit, r
        assert any(m.startswith("wgmma.mma_async") and "bf16" in m for m in r["mma"]), r
        assert r["decode"] > 0 and r["cp_async"] == 0 and r["tma"] > 0 and r["mbarrier_wait"] > 0, r  # all by TMA
        assert r["hgmma"] > 0 and r["hazards"] == [], r  # checked something, found nothing
        assert not persistent or r["local"] == 0, r  # the epilogue's row offsets are not hoisted out of the tile loop
        assert r["loop_local"] == 0, r  # no spill inside the K loop (merged tails spill a few values outside it)
        # split-K launches wait for the pass before them after requesting their first chunks' weights and
        # scales (two copies and the stage's one expect of all its bytes per chunk, stages - 2 chunks); the
        # others are launched without PDL
        assert (r["pdl_waits"], r["tma_before_wait"], r["expect_before_wait"]) == \
            ((1, 2 * (stages - 2), stages - 2) if split > 1 else (0, r["tma"], r["expect_before_wait"])), r


@pytest.mark.parametrize("fmt", FMTS, ids=str)
def test_ws_kernel_cross_compiles_for_sm90(fmt):
    """The warp-specialized kernel compiles for SM90 under its register cap without spills (the
    MMA warps' 128 accumulators, the decode warpgroup's budget by setmaxnreg), inside the shared
    limit and at the model's bytes plus the partitions' little, with wgmma from shared memory on
    both sides (no decode into wgmma registers) and every copy by TMA."""
    from fp4moe.target import get_arch
    from fp4moe.ops.experimental import ws_smem_terms
    from fp4moe.ops.mma_requests import wgmma_compile_request
    from fp4moe.plan.crosscompile import cross_compile

    cfgs = [WgmmaConfig(block_m=256, warps=8, repeats=1, ws=True), WgmmaConfig(block_m=64, warps=8, repeats=1,
                                                                                  stages=6, ws=True)]
    results = cross_compile([wgmma_compile_request(c, fmt, 90, has_bias=True) for c in cfgs])
    for cfg, r in zip(cfgs, results):
        assert r.ok, r.error
        model = sum(each * count for _, each, count in ws_smem_terms(cfg, fmt))
        assert model <= r.shared <= model + 256 and r.shared <= get_arch("sm90").smem_per_block_optin, (cfg, r.shared)
        assert r.spill_bytes == 0 and r.registers <= 168, (cfg, r.registers, r.spill_bytes)
        assert any(m.startswith("wgmma.mma_async") and "bf16" in m for m in r.mma), r.mma
        assert r.wgmma_hazards == (), r.wgmma_hazards  # no register operand to collide with


# ----------------------------------------------------------------------------------------------
# GPU


def _hopper():
    """The GPU has wgmma (the catalogue's word, not a capability test)."""
    from fp4moe.ops.linear import device_arch

    arch = device_arch(torch.device("cuda")) if torch.cuda.is_available() else None
    return arch is not None and arch.bf16_mma == "wgmma"


needs_wgmma = pytest.mark.skipif(torch.cuda.is_available() and not _hopper(),
                                 reason="the wgmma kernel needs an architecture with wgmma (SM90)")


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize("M,N,K", [(1, 256, 128), (100, 300, 224), (256, 4096, 6144), (1000, 6144, 2048),
                                   (77, 512, 64), (130, 272, 1024),
                                   (300, 256, 320), (129, 128, 2880)])  # odd chunk counts: the loop's tail step
def test_gpu_wgmma_linear_matches_reference(fmt, M, N, K):
    from fp4moe.ops.wgmma import launch_linear_wgmma

    configs = (WgmmaConfig(), WgmmaConfig(block_m=64, stages=3), WgmmaConfig(stages=6, group_m=2, warps=8),
               WgmmaConfig(block_m=256, warps=8, repeats=1), WgmmaConfig(block_m=256, warps=4, repeats=1, stages=3),
               WgmmaConfig(block_m=256, warps=8, repeats=1, ws=True),
               WgmmaConfig(block_m=64, warps=8, repeats=1, stages=6, ws=True),
               WgmmaConfig(block_m=32, split_k=4), WgmmaConfig(block_m=64, split_k=3, stages=6),
               WgmmaConfig(block_m=16, warps=8, repeats=1, split_k=8),
               WgmmaConfig(block_m=256, warps=8, repeats=1, persistent=True),  # K = 64: one chunk, not persistent
               WgmmaConfig(block_m=256, warps=8, repeats=1, stages=3, persistent=True))
    check_packed_linear(launch_linear_wgmma, configs, fmt, M, N, K)


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize("M,N,K,cfg", [(64, 6144, 2048, WgmmaConfig(block_m=64, split_k=4)),
                                       (17, 400, 1024, WgmmaConfig(block_m=32, split_k=8)),  # N past the tile
                                       (100, 256, 192, WgmmaConfig(block_m=64, split_k=8))])  # 3 chunks: 3 splits
def test_gpu_split_k_with_pdl_is_bitwise_without(fmt, M, N, K, cfg, monkeypatch):
    """Split-K launches chained by PDL (the pass, then the GEMM requesting its first weights before its
    wait) give bitwise the output of plain launches, call after call, with and without bias, in a CUDA
    graph replayed with new activations each time, and with x already in MMA order (no pass: the
    pack's first launch waits before any load, the next ones do not)."""
    from fp4moe.ops._runtime import pdl_enabled
    from fp4moe.ops.mma_pack import pack_mma
    from fp4moe.ops.wgmma import launch_linear_wgmma, mma_order_rows

    assert pdl_enabled(torch.device("cuda")), "the H200 has PDL: without it this test compares plain launches"
    torch.manual_seed(0)
    xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    w = quantize(torch.randn(N, K, device="cuda"), fmt)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    for b in (None, bias):
        monkeypatch.setenv("FP4MOE_PDL", "0")
        p_plain = pack_mma(w)
        want = [launch_linear_wgmma(x, p_plain, b, torch.empty(M, N, device="cuda", dtype=torch.bfloat16), cfg)
                for x in xs]
        monkeypatch.setenv("FP4MOE_PDL", "1")
        p = pack_mma(w)
        y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        for x, ref in zip(xs + xs, want + want):  # the pack's first launch (PDL = 1), then PDL = 2
            y.fill_(float("nan"))
            launch_linear_wgmma(x, p, b, y, cfg)
            assert torch.equal(y, ref), (cfg, b is None)
        x_in = xs[0].clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch_linear_wgmma(x_in, p, b, y, cfg)
        for x, ref in zip(xs, want):
            x_in.copy_(x)
            y.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, ref), (cfg, b is None, "graph")
        p_mma = pack_mma(w)
        for x, ref in zip(xs + xs, want + want):
            y.fill_(float("nan"))
            launch_linear_wgmma(mma_order_rows(x, p_mma.words.shape[1] * 64), p_mma, b, y, cfg, x_mma_order=True)
            assert torch.equal(y, ref), (cfg, b is None, "x in MMA order")
        assert p_mma.words._fp4moe_launched


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize("M,N,K,programs", [(300, 256, 320, 1),  # 2 tiles of 5 chunks (odd) on one program
                                            (1000, 640, 2880, 3),  # 20 tiles of 45 chunks over 3 programs
                                            (600, 384, 128, 2),  # 2 chunks: a 4-stage ring's refills reach on
                                            (257, 512, 1024, 5)])  # more programs than some of them need
def test_gpu_persistent_programs_over_many_tiles(fmt, M, N, K, programs):
    """Persistent programs given many tiles each (``max_programs``; on 132 SMs the GLM-5 shapes give
    at most a few) are correct, and bitwise equal to a program per tile: the ring's slots and phases
    across tile boundaries, odd chunk counts, K of exactly stages - 2 chunks."""
    from functools import partial

    from fp4moe.ops.mma_pack import pack_mma
    from fp4moe.ops.wgmma import launch_linear_wgmma

    configs = [WgmmaConfig(block_m=256, warps=8, repeats=1, stages=s, persistent=True) for s in (3, 4)]
    check_packed_linear(partial(launch_linear_wgmma, max_programs=programs), configs, fmt, M, N, K)
    torch.manual_seed(1)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    p = pack_mma(quantize(torch.randn(N, K, device="cuda"), fmt))
    for cfg in configs:
        y_tiles, y_persistent = (torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        launch_linear_wgmma(x, p, None, y_tiles, replace(cfg, persistent=False))
        launch_linear_wgmma(x, p, None, y_persistent, cfg, max_programs=programs)
        assert torch.equal(y_tiles, y_persistent), cfg


@pytest.mark.gpu
@needs_wgmma
def test_gpu_fp4_linear_routes_prefill_to_wgmma_and_graphs_work():
    check_fp4linear_graph("fp4_linear_wgmma", (3, 100, 2048))  # 300 rows


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize("fmt,activation,interleaved,per_row,bias",
                         moe_variants(("silu", False, False, False), ("silu", False, True, True),
                                      ("gpt_oss", False, False, True)))
@pytest.mark.parametrize("T,E,k,H,I", [(512, 8, 2, 256, 128), (700, 16, 4, 512, 256), (257, 5, 1, 128, 64),
                                       (300, 6, 3, 320, 96),
                                       (400, 8, 2, 192, 192),  # odd chunk counts in both GEMMs
                                       (300, 6, 2, 128, 32),  # I below half a program's rows
                                       (64, 16, 4, 512, 256), (40, 8, 4, 256, 128)])  # 16, 20 rows: 32-row tiles
def test_gpu_moe_prefill_on_wgmma(fmt, activation, interleaved, per_row, bias, T, E, k, H, I):
    """fp4_moe_experts routes prefill-sized W4A16 layers (gate-then-up w13) to the wgmma kernel:
    same numbers as the reference, dropped slots skipped, deterministic."""
    check_moe_layer("fp4_moe_wgmma", fmt, activation, interleaved, per_row, bias, T, E, k, H, I)


@pytest.mark.gpu
@needs_wgmma
@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize("H,I", [(256, 128), (320, 192)])  # even and odd chunk counts in both GEMMs
def test_gpu_merged_tails_equal_separate_tails(fmt, H, I):
    """``merge_tail``: an expert's full tile runs its short last tile too (a second wgmma on the same
    decoded weights) and that tile's programs do nothing; every output is bitwise what separate
    tail tiles give, for expert row counts around the tile edges (none, a tail alone, a full tile,
    full + 1, full + tail_m, full + tail_m + 1, two full tiles and more)."""
    from fp4moe.ops.dispatch import dispatch
    from fp4moe.ops.moe import fp4_moe_reference, mma_packed_experts, random_moe_problem
    from fp4moe.ops.moe_packed import _run_wgmma

    counts = [0, 1, 32, 33, 127, 128, 129, 150, 160, 161, 200, 256, 257, 288, 289, 300]
    E = len(counts)
    ids = torch.repeat_interleave(torch.arange(E, dtype=torch.int32), torch.tensor(counts))
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))].reshape(-1, 1).cuda()
    T = ids.shape[0]
    p = random_moe_problem(T, E, 1, H, I, fmt, device="cuda", seed=3)
    packed = (mma_packed_experts(p.w13), mma_packed_experts(p.w2))
    plan = dispatch(ids, E, 128)
    outs = []
    for merge in (False, True):
        cfg = WgmmaConfig(block_m=128, stages=4, warps=4, tail_m=32, merge_tail=merge)
        out = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
        outs.append(_run_wgmma(p.x, p.w13, p.w2, packed, ids, p.topk_weights, plan, cfg, 1, "silu", None, None, None,
                               out))
    assert torch.equal(outs[0], outs[1])
    ref = fp4_moe_reference(p.x, p.w13, p.w2, ids, p.topk_weights).float()
    assert float((outs[1].float() - ref).abs().max() / ref.abs().max()) < 2e-2


def test_linear_routing_per_architecture():
    """fp4_linear's choice for bf16 activations: mma.sync at decode everywhere, wgmma above it on
    SM90 only (split along K at small batches), the Triton kernel elsewhere and for native W4A4."""
    from fp4moe.target import get_arch
    from fp4moe.ops.linear import packed_config
    from fp4moe.ops.mma_sync import MMAConfig
    from fp4moe.ops.wgmma import WgmmaConfig

    sm80, sm90, sm120 = get_arch("sm80"), get_arch("sm90"), get_arch("sm120")
    assert isinstance(packed_config("w4a16", sm80, 4, 4096, 4096), MMAConfig)
    assert isinstance(packed_config("w4a16", sm90, 16, 4096, 4096), MMAConfig)
    assert packed_config("w4a16", sm90, 64, 4096, 4096).split_k > 1
    assert isinstance(packed_config("w4a16", sm90, WGMMA_MIN_M, 4096, 4096), WgmmaConfig)
    assert packed_config("w4a16", sm80, 64, 4096, 4096) is None
    assert packed_config("w4a16", sm80, 4096, 4096, 4096) is None
    assert packed_config("w4a16", sm120, 4096, 4096, 4096) is None
    # emulated W4A4 takes the same kernels (on its dequantized activations), native W4A4 none
    assert isinstance(packed_config("w4a4_emulated", sm90, 4096, 4096, 4096), WgmmaConfig)
    assert isinstance(packed_config("w4a4_emulated", sm80, 1, 4096, 4096), MMAConfig)
    assert packed_config("w4a4_native", get_arch("sm100"), 1, 4096, 4096) is None
    assert packed_config("w4a16", None, 4, 4096, 4096) is None

