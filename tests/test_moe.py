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
    with pytest.raises(TypeError, match="topk_ids: expected an integer tensor"):
        fp4_moe_experts(x, w13, w2, ids.float(), wts)
    with pytest.raises(TypeError, match="topk_weights: expected a floating-point tensor"):
        fp4_moe_experts(x, w13, w2, ids, ids)


# ------------------------------------------------------------------------------ GPU


GPU_CASES = [
    Case(1, 256, 8, 6144, 2048, "GLM-5 decode, one token"),
    Case(16, 256, 8, 6144, 2048, "GLM-5 decode"),
    Case(128, 256, 8, 6144, 2048, "GLM-5, 4 rows per expert (the reference gathers [T, 2I, H] fp32)"),
    # 17 rows per expert: past the decode kernels, so the prefill GEMMs (wgmma on SM90, the Triton kernels
    # under FP4MOE_ARCH=sm80/sm89) on expert weights past 2^31 bytes; the reference peaks near 70 GB
    Case(544, 256, 8, 6144, 2048, "GLM-5, 17 rows per expert"),
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
@pytest.mark.parametrize("T,E,k,H,I,per_row", [(1, 64, 8, 1024, 512, False), (7, 16, 4, 512, 256, False),
                                               (7, 16, 4, 512, 256, True), (48, 64, 8, 1024, 512, False),
                                               (128, 16, 4, 512, 256, False)],
                         ids=["decode_one_token", "decode", "decode_per_row_globals", "decode_two_heights",
                              "32_rows_per_expert"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic_scale", "static_scale"])
def test_gpu_w4a4_on_packed_kernels(T, E, k, H, I, per_row, dtype, static):
    """The W4A4 layer on the kernel the runtime picks for this GPU: without FP4 MMA (SM80-SM90) the
    packed W4A16 kernels on its activations quantized to NVFP4 and dequantized to bf16
    (ops.moe_packed._w4a4_activations) where ``packed_moe_kernel`` has one, else (and with FP4 MMA) the Triton
    kernel. The reference's numbers within the W4A4 tolerance, one dropped slot, per-row globals too
    many for the dequantize kernel (8,192), bitwise repeatable, and replayed in a CUDA graph on new
    inputs."""
    from fp4moe.ops.linear import device_arch, target_path
    from fp4moe.ops.moe import packed_moe_kernel, random_moe_problem

    arch = device_arch(torch.device("cuda"))
    p = random_moe_problem(T, E, k, H, I, "nvfp4", device="cuda", dtype=dtype, seed=T, per_row=per_row,
                           dropped=(0, k - 1))
    gs = torch.tensor([0.05], device="cuda") if static else None
    run = lambda: fp4_moe_experts(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights, mode="w4a4",  # noqa: E731
                                  input_global_scale=gs)
    ref = lambda: fp4_moe_reference(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights, mode="w4a4",  # noqa: E731
                                    input_global_scale=gs)
    y = run()
    # the runtime's kernel for this shape on this GPU (off SM90, 32 rows per expert run the Triton kernel)
    emulated = target_path("w4a4", arch) == "w4a4_emulated"
    kernel = packed_moe_kernel(arch, T * k / E, 2 * I, H, False) if emulated else None
    keys = [key.kernel for key in guard._checked]
    want = f"fp4_moe_{kernel}[w4a4," if kernel else "fp4_moe[nvfp4,w4a4,"
    assert any(key.startswith(want) for key in keys), (want, keys)
    assert y.dtype == dtype
    assert_close(y, ref(), "w4a4")
    assert torch.equal(run(), y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    p.x.mul_(-0.5)  # the captured quantize, dequantize and GEMM chain reads the new values
    graph.replay()
    assert_close(out, ref(), "w4a4")


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


@pytest.mark.parametrize("E,N,globals_", [(4, 64, "per_expert"), (4, 64, "one"), (4, 64, "per_row"),
                                           (16, 128, "per_row")], ids=["per_expert", "one", "per_row_kernel",
                                                                       "per_row_torch"])
def test_w4a4_chain_joins_global_scales(E, N, globals_, device):
    """The emulated W4A4 chain (ops.moe_packed._w4a4_activations): x_hat is dequantize(quantize(x)) without
    its global, in x's order (one kernel, fake_quantize_activations) or GEMM 2's MMA K order (the
    quantizer and the dequantize kernel), and the experts' globals come back multiplied by it in the
    shapes the epilogues read without a copy, [E, 1] or [E, N], from the kernel (up to 1,024) or
    torch (2,048 here); dynamic and given activation scales."""
    from dataclasses import replace

    from fp4moe.ops.wgmma import mma_order_rows
    from fp4moe.ops.moe import _weight_globals, random_moe_problem
    from fp4moe.ops.moe_packed import _w4a4_activations
    from fp4moe.ops.quantize import dequantize_activations, quantize_activations

    p = random_moe_problem(3, E, 2, 64, N // 2, "nvfp4", device=device, per_row=globals_ == "per_row")
    w = p.w13 if globals_ != "one" else replace(p.w13, global_scale=p.w13.global_scale[0, 0].clone())
    for scale in (None, torch.tensor(0.0021, device=device)):
        xq = quantize_activations(p.x, scale)
        gx = xq.global_scale.float()
        want = _weight_globals(w)[0] * gx
        for k_stored in (None, 128):
            x_hat, w_g = _w4a4_activations(p.x, scale, w, k_stored)
            plain = dequantize_activations(xq)[0]  # code * block scale (exact; test_quantize_kernel)
            assert torch.equal((plain.float() * gx).cpu(), fp4moe.dequantize(xq.to("cpu"), torch.float32))
            expect = plain if k_stored is None else mma_order_rows(plain, k_stored)
            assert torch.equal(x_hat.view(torch.int16), expect.view(torch.int16))
            assert w_g.global_scale.shape == ((E, N) if globals_ == "per_row" else (E, 1))
            assert torch.equal(_weight_globals(w_g)[0].cpu(), want.cpu())
            assert _weight_globals(w_g)[0].data_ptr() == w_g.global_scale.data_ptr()  # read in place


@pytest.mark.slow  # cross-compilation or many interpreter runs: .ci/run runs it
def test_cross_compile_default_configs():
    """Both grouped GEMMs at GLM-5 decode and prefill configurations fit every target, no spills."""
    from fp4moe.target import get_arch
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


@pytest.mark.parametrize("wg_mode,bias,shared,split", [(0, False, False, 1), (1, True, True, 1), (2, True, False, 3)])
def test_partials_combine_equals_epilogue_then_combine(wg_mode, bias, shared, split, device):
    """The decode path's fused GEMM 2 epilogue + combine (``launch_partials_combine``) gives bitwise
    the result of the two kernels it replaces (``launch_partials_epilogue`` into fp32 pair rows, then
    ``launch_combine``), dropped slots (id -1 and id E) included."""
    from fp4moe.ops.dispatch import dispatch
    from fp4moe.ops.moe import launch_combine, launch_partials_combine, launch_partials_epilogue

    T, E, k, H = 5, 6, 3, 96
    g = torch.Generator().manual_seed(wg_mode * 10 + split)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    ids[1, 2] = -1
    ids[3, 0] = E
    wts = torch.where(ids >= 0, torch.rand(T, k, generator=g), torch.zeros(()))
    ids, wts = ids.to(device), wts.to(device)
    w2 = fp4moe.quantize_stacked(torch.randn(E, H, 64, generator=g), "mxfp4" if wg_mode == 0 else "nvfp4")
    if wg_mode == 2:
        per_row = (w2.global_scale * torch.linspace(0.5, 2.0, H).reshape(1, H)).contiguous()
        w2 = fp4moe.FP4Tensor(w2.data, w2.scales, per_row, w2.shape, "nvfp4")
    w2 = w2.to(device)
    b2 = torch.randn(E, H, generator=g).to(device=device, dtype=torch.bfloat16) if bias else None
    sh = torch.randn(T, H, generator=g).to(device=device, dtype=torch.bfloat16) if shared else None
    plan = dispatch(ids, E, 8)
    part = torch.randn(split, T * k, H, generator=g).to(device)
    pair_w = wts.reshape(-1).contiguous()

    y_pair = torch.full((T * k, H), 1e30, device=device)  # dropped pairs' rows are never written
    launch_partials_epilogue(part, w2, plan, y_pair, swiglu=0, interleaved=False, scatter=True, row_weight=pair_w,
                             bias=b2)
    two = launch_combine(y_pair, ids, k, sh, torch.empty(T, H, device=device, dtype=torch.bfloat16), E)
    fused = launch_partials_combine(part, w2, plan, ids, pair_w, sh, b2,
                                    torch.empty(T, H, device=device, dtype=torch.bfloat16))
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, two)


_PDL_COMPILE = r"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fp4moe.kernels.moe import moe_combine_kernel, moe_partials_combine_kernel, moe_partials_epilogue_kernel
from fp4moe.ops.dispatch import DispatchConfig, compile_requests as dispatch_requests
from fp4moe.ops.routing import RoutingConfig, compile_requests as routing_requests
from fp4moe.models import PRESETS
import importlib

def first_memory_op_after_wait(ptx):
    # whether griddepcontrol.wait precedes every global load, store and atomic (True when no wait)
    ops = [i for i in (ptx.find(op) for op in ("ld.global", "st.global", "atom.global", "red.global")) if i >= 0]
    w = ptx.find("griddepcontrol.wait")
    return w < 0 or not ops or w < min(ops)


out = []
for cc in json.loads(sys.argv[1]):
    pdl = int(cc >= 90)
    reqs = dispatch_requests(16, 256, 8, 8, DispatchConfig.from_heuristic(16, 256), cc)
    reqs += dispatch_requests(4096, 256, 8, 8, DispatchConfig.from_heuristic(4096, 256), cc)
    glm = PRESETS["glm-5"]
    reqs += routing_requests(glm.routing, glm.n_experts, RoutingConfig.from_heuristic(1, 256, 8), cc)
    for r in reqs:
        assert r.constexprs["PDL"] == pdl, (r.kernel, cc)
        module, name = r.kernel.split(":")
        fn = getattr(importlib.import_module(module), name)
        sig = dict(r.signature, **{k: "constexpr" for k in r.constexprs})
        c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=r.constexprs), target=GPUTarget("cuda", cc, 32),
                           options={"num_warps": r.num_warps})
        out.append([r.kernel, cc, pdl, c.asm["ptx"].count("griddepcontrol"), first_memory_op_after_wait(c.asm["ptx"])])
    p = "*fp32"
    i = "*i32"
    for fn, sig, cx in (
        (moe_partials_combine_kernel,
         {"part_ptr": p, "wg_ptr": p, "bias_ptr": "*bf16", "row_w_ptr": p, "ids_ptr": i, "pair_row_ptr": i,
          "shared_ptr": "*bf16", "out_ptr": "*bf16", "R": "i32", "H": "i32", "E": "i32", "stride_ge": "i32",
          "stride_be": "i32", "stride_sm": "i32", "stride_om": "i32"},
         dict(TOP_K=8, SPLIT=1, BLOCK_H=32, WG_MODE=1, HAS_BIAS=False, HAS_SHARED=False, PDL=pdl)),
        (moe_combine_kernel,
         {"y_pair_ptr": p, "ids_ptr": i, "shared_ptr": "*bf16", "out_ptr": "*bf16", "H": "i32", "E": "i32",
          "stride_pm": "i32", "stride_sm": "i32", "stride_om": "i32"},
         dict(TOP_K=8, BLOCK_H=1024, HAS_SHARED=False, PDL=pdl)),
        (moe_partials_epilogue_kernel,
         {"part_ptr": p, "wg_ptr": p, "bias_ptr": "*bf16", "row_out_ptr": i, "row_w_ptr": p, "tile_expert_ptr": i,
          "tile_start_ptr": i, "tile_end_ptr": i, "out_ptr": "*bf16", "R": "i32", "N_w": "i32", "N_out": "i32",
          "I_half": "i32", "stride_ge": "i32", "stride_be": "i32", "stride_om": "i32"},
         dict(SPLIT=1, BLOCK_N=64, BLOCK_M=8, SWIGLU=1, INTERLEAVED=False, SCATTER=False, HAS_RW=0, WG_MODE=1,
              HAS_BIAS=False, PDL=pdl)),
    ):
        sig = dict(sig, **{k: "constexpr" for k in cx})
        c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=GPUTarget("cuda", cc, 32),
                           options={"num_warps": 4})
        out.append([fn.__name__, cc, pdl, c.asm["ptx"].count("griddepcontrol"), first_memory_op_after_wait(c.asm["ptx"])])
print(json.dumps(out))
"""


def test_chain_kernels_use_pdl_from_sm90():
    """Every kernel of the MoE decode chain (routing, dispatch, the epilogues, the combine) waits for
    the previous grid before its first global memory access and lets the next launch
    (``griddepcontrol``) where the target has it, and compiles without it before SM90 (the planner's
    requests ask what the launchers pass)."""
    from layer_checks import run_compile_snippet

    for name, cc, pdl, n, wait_first in run_compile_snippet(_PDL_COMPILE, [80, 90]):
        assert n == 2 * pdl, (name, cc, n)
        assert wait_first, (name, cc)


def test_fused_swiglu_needs_a_full_grid():
    """The decode path's GEMM 1 runs its epilogue in the kernel only with at least
    ``MoETuning.fused_swiglu_min_programs_per_sm`` programs per SM (GLM-5 on 132 SMs: not at 1 token, 8 tiles x 32
    output blocks; yes at 4, 32 x 32), for SiLU on gate-then-up weights with whole K per program."""
    from fp4moe.ops.dispatch import max_tiles
    from fp4moe.ops.mma_sync import MMAConfig
    from fp4moe.ops.moe import fused_programs_per_sm, fuses_swiglu, mma_moe_config

    cfg = mma_moe_config(1)
    per_sm = {T: fused_programs_per_sm(max_tiles(8 * T, 256, cfg.block_m), 2048, cfg, 132) for T in (1, 4)}
    assert not fuses_swiglu(cfg, "silu", False, 2048, per_sm[1])
    assert fuses_swiglu(cfg, "silu", False, 2048, per_sm[4])
    assert not fuses_swiglu(cfg, "gpt_oss", False, 2048, per_sm[4])  # the clamped variant: epilogue kernel
    assert not fuses_swiglu(cfg, "silu", True, 2048, per_sm[4])  # interleaved rows
    assert not fuses_swiglu(cfg, "silu", False, 2056, per_sm[4])  # up rows not on a 16-row block
    assert not fuses_swiglu(MMAConfig(block_m=8, split_k=2), "silu", False, 2048, per_sm[4])


def test_broadcast_globals_are_expanded_once(device):
    """A per-tensor global (or one row shared by the experts) is expanded to the kernels' [E] / [E, N]
    once and kept until the global is written in place; per-expert globals are used as they are."""
    from fp4moe.ops.moe import _weight_globals

    w = fp4moe.quantize_stacked(torch.randn(4, 32, 64), "nvfp4").to(device)
    per_expert, mode = _weight_globals(w)
    assert mode == 1 and per_expert.data_ptr() == w.global_scale.data_ptr()  # [E, 1]: a view, no copy
    one = fp4moe.FP4Tensor(w.data, w.scales, w.global_scale[:1, :1].clone(), w.shape, "nvfp4")
    a, mode = _weight_globals(one)
    assert mode == 1 and a.shape == (4,) and bool((a == one.global_scale.reshape(())).all())
    assert _weight_globals(one)[0] is a  # kept
    one.global_scale.mul_(2.0)  # written in place: expanded again
    b = _weight_globals(one)[0]
    assert b is not a and bool((b == one.global_scale.reshape(())).all())
    row = fp4moe.FP4Tensor(w.data, w.scales, torch.linspace(0.5, 2.0, 32, device=device).reshape(1, 32), w.shape,
                           "nvfp4")
    r, mode = _weight_globals(row)
    assert mode == 2 and r.shape == (4, 32) and torch.equal(r[3], row.global_scale[0])
    assert _weight_globals(row)[0] is r
