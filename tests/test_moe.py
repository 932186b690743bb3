"""The FP4 MoE experts (grouped GEMMs + SwiGLU + combine) against the torch reference."""

from dataclasses import dataclass

import pytest
import torch

import fp4moe
from fp4moe import guard
from fp4moe.guard import TOLERANCES
from fp4moe.ops.moe import MoEGemmConfig, fp4_moe_experts, fp4_moe_reference, moe_experts

def assert_close(out, ref, mode="w4a16"):
    problem = guard.compare(out, ref, TOLERANCES["fp4_moe" if mode == "w4a16" else "fp4_moe_w4a4"])
    assert problem is None, problem


@dataclass(frozen=True)
class Case:
    T: int
    E: int
    k: int
    H: int
    I: int
    why: str
    routing: str = "random"  # random | one_expert | skewed


CPU_CASES = [
    Case(9, 6, 3, 128, 64, "a few tokens, every expert busy"),
    Case(1, 8, 2, 64, 32, "one token: most experts idle"),
    Case(12, 5, 2, 96, 48, "every token on one expert (tile boundaries within one expert)", "one_expert"),
    Case(7, 7, 1, 64, 32, "top-k = 1, E prime"),
    Case(4, 4, 4, 64, 32, "top-k = E"),
    Case(5, 160, 2, 64, 32, "E = 160 (not a power of two): many empty experts"),
    Case(3, 4, 2, 80, 48, "H and I not multiples of the tiles"),
]


def _ids(case: Case, g: torch.Generator) -> torch.Tensor:
    if case.routing == "one_expert":
        first = torch.full((case.T, 1), 3 % case.E)
        rest = torch.stack([torch.randperm(case.E, generator=g)[: case.k] for _ in range(case.T)])
        rest = torch.where(rest == first, (first + 1) % case.E, rest)[:, : case.k - 1]
        return torch.cat([first, rest], 1).to(torch.int32)
    return torch.stack([torch.randperm(case.E, generator=g)[: case.k] for _ in range(case.T)]).to(torch.int32)


def _problem(case: Case, fmt: str, device, bias=False):
    g = torch.Generator().manual_seed(case.T * 131 + case.E * 7 + case.H)
    # weights are drawn and quantized where the test runs: at GLM-5 size (6.4 G elements) the CPU
    # would spend minutes on them
    gw = torch.Generator(device=device).manual_seed(case.E * 7 + case.H)
    x = torch.randn(case.T, case.H, generator=g).to(device=device, dtype=torch.bfloat16)
    w13 = fp4moe.quantize_stacked(torch.randn(case.E, 2 * case.I, case.H, generator=gw, device=device), fmt)
    w2 = fp4moe.quantize_stacked(torch.randn(case.E, case.H, case.I, generator=gw, device=device), fmt)
    ids = _ids(case, g).to(device)
    wts = torch.rand(case.T, case.k, generator=g).to(device)
    b13 = torch.randn(case.E, 2 * case.I, generator=g).to(device=device, dtype=torch.bfloat16) if bias else None
    b2 = torch.randn(case.E, case.H, generator=g).to(device=device, dtype=torch.bfloat16) if bias else None
    return x, w13, w2, ids, wts, b13, b2


@pytest.fixture(autouse=True)
def _fresh_guard():
    guard.reset()
    yield
    guard.reset()


SMALL = (MoEGemmConfig(16, 16, 64, 4, 1), MoEGemmConfig(16, 16, 64, 4, 1))


# MXFP4 needs H and I to be multiples of its 32-element block: those cases are not generated for it
MOE_CASES = [(c, fmt, mode) for c in CPU_CASES
             for fmt, mode in (("nvfp4", "w4a16"), ("mxfp4", "w4a16"), ("nvfp4", "w4a4"))
             if fmt != "mxfp4" or (c.H % 32 == 0 and c.I % 32 == 0)]


@pytest.mark.parametrize("case,fmt,mode", MOE_CASES,
                         ids=lambda v: f"T{v.T}_E{v.E}_k{v.k}_H{v.H}_I{v.I}_{v.routing}" if isinstance(v, Case) else str(v))
def test_experts_match_reference(case, fmt, mode, device):
    x, w13, w2, ids, wts, _, _ = _problem(case, fmt, device)
    shared = torch.randn_like(x)
    out = fp4_moe_experts(x, w13, w2, ids, wts, shared_out=shared, configs=SMALL, mode=mode)
    assert_close(out, fp4_moe_reference(x, w13, w2, ids, wts, shared_out=shared, mode=mode), mode)


@pytest.mark.parametrize("activation,interleaved", [("gpt_oss", True), ("gpt_oss", False), ("silu", True)])
def test_gpt_oss_activation_layout_and_biases(activation, interleaved, device):
    case = Case(6, 4, 2, 64, 32, "gpt-oss style")
    x, w13, w2, ids, wts, b13, b2 = _problem(case, "mxfp4", device, bias=True)
    kw = dict(activation=activation, interleaved=interleaved, w13_bias=b13, w2_bias=b2)
    assert_close(fp4_moe_experts(x, w13, w2, ids, wts, configs=SMALL, **kw),
                 fp4_moe_reference(x, w13, w2, ids, wts, **kw))


def test_default_configs_custom_op_and_determinism(device):
    case = Case(8, 6, 2, 64, 32, "")
    x, w13, w2, ids, wts, _, _ = _problem(case, "nvfp4", device)
    a = moe_experts(x, w13, w2, ids, wts)
    b = moe_experts(x, w13, w2, ids, wts)
    assert torch.equal(a, b)  # bitwise: fixed summation order, no atomics
    assert_close(a, fp4_moe_reference(x, w13, w2, ids, wts))


def test_zero_tokens(device):
    x, w13, w2, ids, wts, _, _ = _problem(Case(2, 4, 2, 64, 32, ""), "nvfp4", device)
    assert fp4_moe_experts(x[:0], w13, w2, ids[:0], wts[:0]).shape == (0, 64)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_dropped_slots_are_skipped(mode, device, monkeypatch):
    """OEA leaves slots it cannot fill as id -1 (weight 0), and dispatch drops any id outside
    [0, E): no expert runs for them and the combine skips their rows, which are never written
    (here filled with huge values to prove it; W4A4 must also keep them out of the re-quantized
    SwiGLU output's global scale)."""
    import fp4moe.ops.moe as moe_ops

    real_empty = torch.empty

    def junk_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(1e30) if t.is_floating_point() else t

    monkeypatch.setattr(moe_ops.torch, "empty", junk_empty)
    case = Case(5, 6, 3, 64, 32, "")
    x, w13, w2, ids, wts, _, _ = _problem(case, "nvfp4", device)
    ids = ids.clone()
    ids[1, 2] = -1
    ids[3, 1:] = -1
    ids[4, 0] = case.E  # out of range: dropped too
    wts = torch.where(ids >= 0, wts, torch.zeros_like(wts))
    out = fp4_moe_experts(x, w13, w2, ids, wts, configs=SMALL, mode=mode)
    assert torch.isfinite(out).all()
    assert_close(out, fp4_moe_reference(x, w13, w2, ids, wts, mode=mode), mode)


def test_bad_inputs(device):
    x, w13, w2, ids, wts, _, _ = _problem(Case(3, 4, 2, 64, 32, ""), "nvfp4", device)
    w2_wrong = fp4moe.quantize(torch.randn(4, 64, 48), "nvfp4").to(device)
    with pytest.raises(ValueError, match=r"w13 \(4, 64, 64\) and w2 \(4, 64, 48\) disagree"):
        fp4_moe_experts(x, w13, w2_wrong, ids, wts)
    w2_mx = fp4moe.quantize(torch.randn(4, 64, 32), "mxfp4").to(device)
    with pytest.raises(ValueError, match="w13 nvfp4 and w2 mxfp4"):
        fp4_moe_experts(x, w13, w2_mx, ids, wts)
    with pytest.raises(ValueError, match="topk_weights: expected shape"):
        fp4_moe_experts(x, w13, w2, ids, wts[:, :1])
    with pytest.raises(ValueError, match=r"x: expected \[T, 64\]"):
        fp4_moe_experts(x[:, :32], w13, w2, ids, wts)
    with pytest.raises(ValueError, match="activation"):
        fp4_moe_experts(x, w13, w2, ids, wts, activation="gelu")


# ------------------------------------------------------------------------------ GPU


GPU_CASES = [
    Case(1, 256, 8, 6144, 2048, "GLM-5 decode, one token"),
    Case(16, 256, 8, 6144, 2048, "GLM-5 decode"),
    Case(128, 256, 8, 6144, 2048, "GLM-5, 4 rows per expert (the reference gathers [T, 2I, H] fp32)"),
    Case(64, 128, 8, 2048, 768, "Qwen3-30B-A3B"),
    Case(64, 128, 8, 2048, 768, "Qwen3-30B-A3B, all tokens on one expert", "one_expert"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"T{c.T}_E{c.E}_H{c.H}_{c.routing}")
def test_gpu_model_sizes(case, mode):
    x, w13, w2, ids, wts, _, _ = _problem(case, "nvfp4", "cuda")
    out = moe_experts(x, w13, w2, ids, wts, mode=mode)
    assert_close(out, fp4_moe_reference(x, w13, w2, ids, wts, mode=mode), mode)
    assert torch.equal(out, moe_experts(x, w13, w2, ids, wts, mode=mode))


@pytest.mark.gpu
def test_gpu_cuda_graph_and_compile():
    case = Case(16, 64, 4, 1024, 512, "")
    x, w13, w2, ids, wts, _, _ = _problem(case, "nvfp4", "cuda")
    ref = fp4_moe_reference(x, w13, w2, ids, wts)
    moe_experts(x, w13, w2, ids, wts)  # guard and compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(x, w13, w2, ids, wts)
    graph.replay()
    assert_close(out, ref)
    f = torch.compile(lambda a: moe_experts(a, w13, w2, ids, wts), fullgraph=True)
    assert_close(f(x), ref)


def test_cross_compile_default_configs():
    """Both grouped GEMMs at GLM-5 decode and prefill configurations fit every target, no spills."""
    from fp4moe.arch import get_arch
    from fp4moe.ops.moe import choose_moe_configs, compile_request
    from fp4moe.plan.crosscompile import cross_compile

    reqs = []
    for T in (16, 4096):
        g1, g2 = choose_moe_configs(T, 8, 256, 6144, 2048)
        for cc in (80, 90, 120):
            reqs.append(compile_request(g1, "nvfp4", cc, swiglu=1, gather=True, scatter=False))
            reqs.append(compile_request(g2, "nvfp4", cc, swiglu=0, gather=False, scatter=True, out_dtype="fp32"))
        for cc, act in ((90, 1), (120, 2), (100, 2)):  # W4A4: emulated on Hopper, native FP4 MMA on Blackwell
            w1, _ = choose_moe_configs(T, 8, 256, 6144, 2048, arch=get_arch(cc), mode="w4a4")
            reqs.append(compile_request(w1, "nvfp4", cc, swiglu=1, gather=True, scatter=False, act=act))
    for q, r in zip(reqs, cross_compile(reqs)):
        assert r.ok, r.error
        if q.constexprs["ACT"] == 2:  # W4A4 on Blackwell: native block-scaled FP4 MMA, never a decode fallback
            assert any("kind::mxf4nvf4" in m for m in r.mma), (q.cc, r.mma)
        assert r.shared <= get_arch(q.cc).smem_per_block_optin
        assert r.spill_bytes == 0, r.ptxas_log
        assert any("mma" in m for m in r.mma)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("per", ["expert", "row"])
def test_per_expert_and_per_row_global_scales(per, interleaved, device):
    """Checkpoints quantize each expert (and gate / up) with its own global: [E, 1] or [E, N].
    Per row, gate and up rows get different globals, so a row-indexing bug shows."""
    case = Case(6, 4, 2, 64, 32, "")
    g = torch.Generator().manual_seed(9)
    x = torch.randn(case.T, case.H, generator=g).to(device=device, dtype=torch.bfloat16)
    mags = torch.tensor([0.5, 1.0, 4.0, 0.25])
    w13 = fp4moe.quantize_stacked(torch.randn(4, 2 * case.I, case.H, generator=g) * mags.reshape(4, 1, 1))
    w2 = fp4moe.quantize_stacked(torch.randn(4, case.H, case.I, generator=g) * mags.reshape(4, 1, 1))
    if per == "row":
        row_factor = torch.linspace(0.25, 4.0, 2 * case.I).reshape(1, 2 * case.I)  # gate rows != up rows
        w13 = fp4moe.FP4Tensor(w13.data, w13.scales, (w13.global_scale * row_factor).contiguous(), w13.shape, "nvfp4")
    w13, w2 = w13.to(device), w2.to(device)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(case.T)]).to(device=device, dtype=torch.int32)
    wts = torch.rand(case.T, 2, generator=g).to(device)
    kw = dict(interleaved=interleaved)
    assert_close(fp4_moe_experts(x, w13, w2, ids, wts, configs=SMALL, **kw), fp4_moe_reference(x, w13, w2, ids, wts, **kw))


def test_bias_and_shared_shapes_are_checked(device):
    x, w13, w2, ids, wts, _, _ = _problem(Case(3, 4, 2, 64, 32, ""), "nvfp4", device)
    with pytest.raises(ValueError, match=r"w13_bias: expected shape \(4, 64\)"):
        fp4_moe_experts(x, w13, w2, ids, wts, w13_bias=torch.zeros(64, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"shared_out: expected shape \(3, 64\)"):
        fp4_moe_experts(x, w13, w2, ids, wts, shared_out=x[:2])
