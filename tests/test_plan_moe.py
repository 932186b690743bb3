"""The MoE grouped GEMMs in the planner (kernel ``fp4_moe_gemm``): their defaults cross-compile
within the chip's shared memory with the right MMA, the shared-memory model agrees with the
compiled kernels, and ``plan_op`` returns a legal configuration (CPU only).

One module-wide compile cache: every configuration is compiled once for the whole file.
"""

from __future__ import annotations

import pytest

from fp4moe.target import get_arch
from fp4moe.ops.moe import MoEGemmConfig, choose_moe_configs
from fp4moe.plan.cache import CompileCache
from fp4moe.plan.crosscompile import cross_compile
from fp4moe.plan.planner import SPILL_LIMIT_BYTES, plan_many, plan_op
from fp4moe.plan.space import KERNELS, MoEGemmProblem, get_kernel

SPEC = get_kernel("fp4_moe_gemm")
SM120_FP4_MMA = "mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale"


def agrees(model: int, compiled: int) -> bool:
    """The model's tolerance: within 5% of the compiled size or 1 KiB, whichever is larger."""
    return abs(model - compiled) <= max(1024, 0.05 * compiled)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> CompileCache:
    return CompileCache(tmp_path_factory.mktemp("plan-moe-cache"))


# GLM-5: hidden 6144, 256 experts, top-8, expert intermediate 2048 (TP1) or 256 (TP8)
H, E, TOP_K = 6144, 256, 8


def glm5_problems(mode: str) -> list[MoEGemmProblem]:
    out = []
    for T in (16, 4096):
        for inter in (2048, 256):
            out.append(MoEGemmProblem(T, TOP_K, E, inter, H, gemm=1, mode=mode))
            out.append(MoEGemmProblem(T, TOP_K, E, H, inter, gemm=2, mode=mode))
    return out


@pytest.mark.slow  # cross-compiles both GEMMs per target
@pytest.mark.parametrize("cc", [120, 90])
def test_heuristic_of_both_gemms_fits_at_glm5_shapes(cc, cache):
    """The runtime's configurations (``choose_moe_configs``) at GLM-5 TP1 and TP8, decode and
    prefill, both GEMMs, W4A16 and W4A4: compile, fit, no spills, the architecture's MMA (on SM120
    W4A4 the native block-scaled FP4 mma.sync), and the shared-memory model agrees."""
    arch = get_arch(cc)
    problems = glm5_problems("w4a16") + glm5_problems("w4a4")
    configs = [SPEC.heuristic(p, arch) for p in problems]
    for p, c in zip(problems, configs):
        H_, I_ = p.hidden_and_intermediate()
        assert c == choose_moe_configs(p.T, p.top_k, p.E, H_, I_, arch=arch, mode=p.mode)[p.gemm - 1]
    results = cross_compile([SPEC.compile_request(c, p, arch) for p, c in zip(problems, configs)], cache=cache)
    for p, c, r in zip(problems, configs, results):
        where = f"{p} {c} on sm{cc}"
        assert r.ok, f"{where}: {r.error}"
        assert r.shared <= arch.smem_per_block_optin, f"{where}: {r.shared:,} B"
        assert r.spill_bytes is not None and r.spill_bytes <= SPILL_LIMIT_BYTES, f"{where}: {r.ptxas_log}"
        assert SPEC.expected_mma(p, arch).violation(r.mma) is None, f"{where}: {r.mma}"
        if cc == 120 and p.mode == "w4a4":
            assert SPEC.variant(p, arch) == "w4a4_native"
            assert any(m.startswith(SM120_FP4_MMA) for m in r.mma), f"{where}: {r.mma}"
        if cc == 90 and p.mode == "w4a4":
            assert SPEC.variant(p, arch) == "w4a4_emulated"
            assert not any("mxf4" in m for m in r.mma)
        model = SPEC.smem_model(c, p, arch).total
        assert agrees(model, r.shared), f"{where}: model {model:,} B, compiled {r.shared:,} B"


@pytest.mark.parametrize("cc", [120, 90])
@pytest.mark.slow  # cross-compilation or many interpreter runs: .ci/run runs it
def test_planner_picks_legal_configs_and_the_model_agrees_with_what_it_compiles(cc, cache):
    """``plan_many`` over GLM-5's grouped GEMMs: a legal, compiled choice for each (shared memory
    within the limit, no spills, the expected MMA) and every candidate it compiled within the
    model's tolerance."""
    arch = get_arch(cc)
    mode = "w4a4" if cc == 120 else "w4a16"
    problems = [p for p in glm5_problems(mode) if p.K != 256 or p.T == 16][:6]
    results = plan_many([("fp4_moe_gemm", p) for p in problems], arch, cache=cache)
    compiled = 0
    for p, result in zip(problems, results):
        v = result.chosen
        assert v is not None and v.legal and v.stage == "compile", result.explain()
        assert v.config in SPEC.candidates(p, arch) or v.config == SPEC.heuristic(p, arch)
        assert v.shared_compiled <= arch.smem_per_block_optin and v.spills == 0
        assert SPEC.expected_mma(p, arch).violation(v.mma) is None
        assert result.variant == SPEC.variant(p, arch)
        for judged in result.legal + result.rejected:
            if judged.compiled is None or not judged.compiled.ok:
                continue
            compiled += 1
            assert agrees(judged.shared_model, judged.shared_compiled), \
                f"{p} {judged.config}: model {judged.shared_model:,} B, compiled {judged.shared_compiled:,} B " \
                f"({judged.smem.describe()})"
    assert compiled >= len(problems)


def test_plan_op_on_rtx_pro_6000_w4a4_decode(cache):
    """One grouped GEMM planned for the RTX PRO 6000: a legal configuration, native FP4 MMA."""
    p = MoEGemmProblem(16, TOP_K, E, 256, H, gemm=1, mode="w4a4")
    result = plan_op("fp4_moe_gemm", p, gpu="rtx pro 6000", cache=cache)
    assert result.kernel == "fp4_moe_gemm" and result.variant == "w4a4_native"
    v = result.chosen
    assert v is not None and v.legal and isinstance(v.config, MoEGemmConfig)
    assert v.shared_compiled <= 101_376 and any(m.startswith(SM120_FP4_MMA) for m in v.mma)
    assert "fp4_moe_gemm [w4a4_native] GEMM 1 (gate+up)" in result.explain()


def test_problem_candidates_and_time_model():
    assert "fp4_moe_gemm" in KERNELS
    with pytest.raises(ValueError, match="gemm"):
        MoEGemmProblem(16, 8, 256, 2048, 6144, gemm=3)
    with pytest.raises(ValueError, match="NVFP4"):
        MoEGemmProblem(16, 8, 256, 2048, 6144, fmt="mxfp4", mode="w4a4")
    with pytest.raises(ValueError, match="block size"):
        MoEGemmProblem(16, 8, 256, 2048, 6100)
    decode = MoEGemmProblem(16, 8, 256, 2048, 6144)
    assert decode.active_experts == 128 and decode.weight_rows == 4096
    sm120, sm100 = get_arch(120), get_arch(100)
    assert {c.block_m for c in SPEC.candidates(decode, sm120)} == {16}  # 0.5 rows per expert
    prefill = MoEGemmProblem(4096, 8, 256, 2048, 6144, mode="w4a4")
    assert {c.block_m for c in SPEC.candidates(prefill, sm120)} == {16, 64, 128}
    assert {c.block_n for c in SPEC.candidates(prefill, sm120)} == {32, 64, 128}
    assert {c.block_n for c in SPEC.candidates(prefill, sm100)} == {128}  # tcgen05 FP4: 128-row MMA
    assert SPEC.variant(prefill, sm100) == "w4a4_native" and SPEC.variant(prefill, get_arch(90)) == "w4a4_emulated"
    # decode is bound by the active experts' weights: half as many experts, about half the time
    gpu = "rtx pro 6000"
    from fp4moe.target import find_gpu

    g = find_gpu(gpu)
    cfg = SPEC.heuristic(decode, sm120)
    t16 = SPEC.model_time(cfg, decode, g)
    t8 = SPEC.model_time(cfg, MoEGemmProblem(8, 8, 256, 2048, 6144), g)
    assert t16.limiter == "memory" and 1.8 < t16.us / t8.us < 2.2
    assert t16.bytes >= 128 * (4096 * 6144 // 2 + 4096 * 6144 // 16)
    # requests follow the launcher: GEMM 1 gathers and applies SwiGLU, GEMM 2 scatters fp32 rows
    r1 = SPEC.compile_request(cfg, decode, sm120)
    r2 = SPEC.compile_request(cfg, MoEGemmProblem(16, 8, 256, 6144, 2048, gemm=2, mode="w4a4"), sm120)
    assert r1.constexprs["SWIGLU"] == 1 and r1.constexprs["GATHER"] and r1.constexprs["ACT"] == 0
    assert r2.constexprs["SCATTER"] and r2.signature["out_ptr"] == "*fp32" and r2.constexprs["ACT"] == 2


def test_off_grid_configurations_take_a_safe_upper_bound(cache):
    """Outside the measured grid the model is an upper bound: never below the compiled size."""
    arch = get_arch(120)
    off = [(MoEGemmConfig(32, 32, 128, 4, 2), MoEGemmProblem(4096, TOP_K, E, 256, H, gemm=1)),
           (MoEGemmConfig(16, 32, 64, 2, 4), MoEGemmProblem(4096, TOP_K, E, H, 256, gemm=2)),
           (MoEGemmConfig(64, 32, 128, 4, 2), MoEGemmProblem(4096, TOP_K, E, H, 256, gemm=2, mode="w4a4"))]
    results = cross_compile([SPEC.compile_request(c, p, arch) for c, p in off], cache=cache)
    for (c, p), r in zip(off, results):
        assert r.ok, r.error
        model = SPEC.smem_model(c, p, arch)
        assert "bound" in model.describe()
        assert model.total >= r.shared, f"{p} {c}: bound {model.total:,} B < compiled {r.shared:,} B"


def test_pinned_block_m_and_the_model_plan_share_one_dispatch_plan():
    """Both GEMMs of a layer run on one dispatch plan: ``fp4moe plan`` pins block_m to the
    runtime's, so the two grouped GEMMs it picks run together."""
    from fp4moe.models import get_model
    from fp4moe.plan.cli import moe_problem, plan_model

    arch = get_arch(120)
    pinned = MoEGemmProblem(4096, TOP_K, E, 256, H, gemm=1, block_m=64)
    assert {c.block_m for c in SPEC.candidates(pinned, arch)} == {64}
    assert SPEC.heuristic(pinned, arch).block_m == 64 and "block_m=64" in str(pinned)
    with pytest.raises(ValueError, match="block_m"):
        MoEGemmProblem(16, TOP_K, E, 256, H, block_m=48)
    glm5 = get_model("glm-5")
    p1 = moe_problem(glm5, 4096, 1, tp=8, mode="w4a4", arch=arch)
    assert (p1.T, p1.top_k, p1.E, p1.N, p1.K, p1.block_m) == (4096, 8, 256, 256, 6144, 128)
    p2 = moe_problem(glm5, 16, 2, tp=1, ep=8, arch=arch)
    assert (p2.T, p2.E, p2.N, p2.K) == (2, 32, 6144, 2048)
    planned = plan_model(glm5, arch="sm120", tp=8, tokens=(1, 64, 4096), mode="w4a4", compile=False)
    for t in (1, 64, 4096):
        grouped = [r for tt, _, _, r in planned if tt == t and r.kernel == "fp4_moe_gemm"]
        assert [r.problem.gemm for r in grouped] == [1, 2]
        assert grouped[0].chosen.config.block_m == grouped[1].chosen.config.block_m


def test_decode_heights_planned_as_two_launches_per_gemm():
    """Where the runtime runs each decode GEMM as two launches (``ops.moe.MMAHeights``: GLM-5 on
    SM90 at 256 tokens, 8 rows per expert), ``fp4moe plan`` lists one row per class with that
    class's configuration and its expected share of the rows (binomial under uniform routing:
    ~59% of the experts hold at most 8 rows); the classes' rows add up to the layer's pairs."""
    from fp4moe.models import get_model
    from fp4moe.ops.moe import mma_moe_gemm2_config, mma_moe_layer_config
    from fp4moe.plan.cli import plan_model

    heights = mma_moe_layer_config(8.0)
    planned = plan_model(get_model("glm-5"), arch="sm90", tokens=(16, 256), compile=False)
    rows = [(t, name, r) for t, name, _, r in planned if r.kernel == "fp4_moe_mma"]
    assert [name for t, name, _ in rows if t == 16] == ["experts.w13 (gate+up)", "experts.w2 (down)"]
    at256 = [(name, r) for t, name, r in rows if t == 256]
    assert [name for name, _ in at256] == [
        "experts.w13 (gate+up), experts of <= 8 rows", "experts.w13 (gate+up), experts of > 8 rows",
        "experts.w2 (down), experts of <= 8 rows", "experts.w2 (down), experts of > 8 rows"]
    (_, low), (_, high) = heights.classes()
    for i in (0, 2):
        small, large = at256[i][1], at256[i + 1][1]
        if i == 0:
            assert small.chosen.config == heights.small and large.chosen.config == heights.large
        else:  # GEMM 2: the runtime's configuration of each class (the short tiles' with two row blocks)
            assert small.chosen.config == mma_moe_gemm2_config(heights.small, low) != heights.small
            assert large.chosen.config == mma_moe_gemm2_config(heights.large, high) == heights.large
        assert small.problem.pairs + large.problem.pairs == 256 * TOP_K
        assert 145 <= small.problem.active_experts <= 160 and 95 <= large.problem.active_experts <= 110
        assert small.problem.rows == (0, 8) and "experts of 0 < rows <= 8" in str(small.problem)
    with pytest.raises(ValueError, match="rows"):
        MoEGemmProblem(256, TOP_K, E, 2048, H, rows=(8, 8))


def test_spills_outside_the_wgmma_main_loop_are_kept_and_reported(cache):
    """A wgmma configuration whose spills all sit outside the main loop (GEMM 2 without tail tiles:
    255 registers, an epilogue spill) stays legal and is reported as such; the same spill inside
    the loop (a synthetic compile result) is refused."""
    import dataclasses

    from fp4moe.ops.wgmma import WgmmaConfig
    from fp4moe.plan.planner import _compiled_verdict, _resolve, _verdict_line, evaluate

    problem = MoEGemmProblem(4096, 8, 256, 6144, 2048, gemm=2)
    v = evaluate("fp4_moe_wgmma", problem, "sm90", config=WgmmaConfig(block_m=128, warps=4), cache=cache)
    assert v.compiled is not None and v.compiled.ok
    assert v.compiled.spill_bytes > SPILL_LIMIT_BYTES and v.compiled.loop_spill_ops == 0, v.compiled.ptxas_log
    assert not v.reasons and "outside the main loop" in _verdict_line(v)
    arch, gpu = _resolve(get_arch("sm90"), None)
    in_loop = dataclasses.replace(v.compiled, loop_spill_ops=2)
    refused = _compiled_verdict(get_kernel("fp4_moe_wgmma"), v, problem, arch, gpu, in_loop)
    assert any("spills" in r for r in refused.reasons)
