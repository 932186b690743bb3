"""fp4moe.nn.FP4MoE: the whole block (router -> routing -> experts -> combine + shared expert)."""

import pytest
import torch

from fp4moe import guard
from fp4moe.guard import TOLERANCES
from fp4moe.models import Routing
from fp4moe.nn import FP4Linear, FP4MoE
from fp4moe.ops.linear import fp4_linear_reference
from fp4moe.ops.moe import fp4_moe_reference
from fp4moe.ops.routing import route_reference

ROUTINGS = [
    Routing("softmax", top_k=2),  # Qwen3-MoE
    Routing("sigmoid_bias", top_k=2, n_group=2, topk_group=1, routed_scaling_factor=2.5),  # DeepSeek-V3 / GLM-5
    Routing("gpt_oss", top_k=2, renormalize=False),
]


def _block(routing, device, shared: bool, k0=None):
    g = torch.Generator().manual_seed(3)
    E, H, I = 6, 64, 32
    router = torch.randn(E, H, generator=g).to(device=device, dtype=torch.bfloat16)
    w13 = torch.randn(E, 2 * I, H, generator=g)
    w2 = torch.randn(E, H, I, generator=g)
    kw = {}
    if routing.kind == "sigmoid_bias":
        kw["selection_bias"] = (torch.randn(E, generator=g) * 0.1).to(device)
    sgu = torch.randn(2 * I, H, generator=g).to(device) if shared else None
    sd = torch.randn(H, I, generator=g).to(device) if shared else None
    block = FP4MoE.from_bf16(router, w13.to(device), w2.to(device), routing, shared_gate_up=sgu, shared_down=sd,
                             k0=k0, **kw)
    x = torch.randn(7, H, generator=g).to(device=device, dtype=torch.bfloat16)
    return block, x


def _reference(block: FP4MoE, x: torch.Tensor) -> torch.Tensor:
    logits = torch.nn.functional.linear(x, block.router_weight.to(x.dtype))
    r = route_reference(logits, block.routing, block.selection_bias, k0=block.k0)
    shared = None
    if block.shared_gate_up is not None:
        gu = fp4_linear_reference(x, block.shared_gate_up.weight_fp4)
        g, u = gu.chunk(2, dim=-1)
        h = torch.nn.functional.silu(g.float()).mul(u.float()).to(x.dtype)
        shared = fp4_linear_reference(h, block.shared_down.weight_fp4)
    return fp4_moe_reference(x, block.w13, block.w2, r.topk_ids, r.topk_weights, shared_out=shared)


@pytest.fixture(autouse=True)
def _fresh_guard():
    guard.reset()
    yield


@pytest.mark.parametrize("routing", ROUTINGS, ids=lambda r: r.kind)
@pytest.mark.parametrize("shared", [False, True])
def test_block_matches_reference(routing, shared, device):
    block, x = _block(routing, device, shared)
    out = block(x.reshape(1, 7, -1))
    assert out.shape == (1, 7, 64)
    problem = guard.compare(out.reshape(7, -1), _reference(block, x), TOLERANCES["fp4_moe"])
    assert problem is None, problem


def test_block_with_oea_reports_stats(device):
    block, x = _block(ROUTINGS[0], device, shared=False, k0=1)
    out = block(x)
    problem = guard.compare(out, _reference(block, x), TOLERANCES["fp4_moe"])
    assert problem is None, problem
    assert block.last_stats is not None


def test_block_checks_its_parts(device):
    block, _ = _block(ROUTINGS[0], device, shared=False)
    with pytest.raises(ValueError, match=r"router_weight: expected \[6, 64\]"):
        FP4MoE(block.router_weight[:, :32], block.w13, block.w2, ROUTINGS[0])
    with pytest.raises(ValueError, match="k0"):
        FP4MoE(block.router_weight, block.w13, block.w2, ROUTINGS[0], k0=5)
    with pytest.raises(ValueError, match="give both or neither"):
        FP4MoE(block.router_weight, block.w13, block.w2, ROUTINGS[0],
               shared_gate_up=FP4Linear(64, 64, device=device))


def test_block_refuses_bad_parts_at_construction(device):
    import fp4moe

    block, x = _block(ROUTINGS[0], device, shared=False)
    R, w13, w2 = block.router_weight, block.w13, block.w2
    bad = [
        (TypeError, r"w13: expected a stacked FP4Tensor \[E, N, K\].*FP4Tensor\(64, 64\)",
         lambda: FP4MoE(R, fp4moe.quantize(torch.randn(64, 64)).to(device), w2, ROUTINGS[0])),
        (ValueError, r"routing.top_k: expected 1..E=6, got 7", lambda: FP4MoE(R, w13, w2, Routing("softmax", top_k=7))),
        (ValueError, r"routing.n_group: expected a divisor of E=6, got 4",
         lambda: FP4MoE(R, w13, w2, Routing("sigmoid_bias", top_k=2, n_group=4))),
        (ValueError, r"selection_bias: 'softmax' routing takes no bias",
         lambda: FP4MoE(R, w13, w2, ROUTINGS[0], selection_bias=torch.zeros(6, device=device))),
        (ValueError, r"selection_bias: expected shape \(6,\)",
         lambda: FP4MoE(R, w13, w2, ROUTINGS[1], selection_bias=torch.zeros(5, device=device))),
        (ValueError, r"k0: expected an int in 1..top_k=2, got True", lambda: FP4MoE(R, w13, w2, ROUTINGS[0], k0=True)),
        (ValueError, r"mode: expected 'w4a16' or 'w4a4', got 'w8a8'", lambda: FP4MoE(R, w13, w2, ROUTINGS[0], mode="w8a8")),
        (ValueError, r"activation: expected 'silu' or 'gpt_oss', got 'gelu'",
         lambda: FP4MoE(R, w13, w2, ROUTINGS[0], activation="gelu")),
        (ValueError, r"w13_bias: expected shape \(6, 64\)",
         lambda: FP4MoE(R, w13, w2, ROUTINGS[0], w13_bias=torch.zeros(6, 32, device=device))),
        (ValueError, r"check_finite: expected False, True or 'async'",
         lambda: FP4MoE(R, w13, w2, ROUTINGS[0], check_finite="yes")),
    ]
    for exc, match, make in bad:
        with pytest.raises(exc, match=match):
            make()
    mx13 = fp4moe.quantize_stacked(torch.randn(6, 64, 64), "mxfp4").to(device)
    mx2 = fp4moe.quantize_stacked(torch.randn(6, 64, 32), "mxfp4").to(device)
    with pytest.raises(ValueError, match="mode: 'w4a4' needs NVFP4 expert weights, got mxfp4"):
        FP4MoE(R, mx13, mx2, ROUTINGS[0], mode="w4a4")
    with pytest.raises(ValueError, match=r"x: expected \[\.\.\., 64\] \(hidden size 64\), got \(7, 32\)"):
        block(x[:, :32])
    with pytest.raises(TypeError, match="x: expected bfloat16 or float16, got torch.float32"):
        block(x.float())


def test_block_nan_router_logits(device):
    block, x = _block(ROUTINGS[1], device, shared=False)
    x = x.clone()
    x[2] = float("nan")
    out = block(x)  # default: the NaN token's row is NaN, the others are exact
    assert bool(out[2].isnan().all()) and not bool(out[[0, 1, 3, 4, 5, 6]].isnan().any())
    block.check_finite = True
    with pytest.raises(ValueError, match="NaN/Inf in router logits at token 2"):
        block(x)


def test_block_state_dict_round_trip_and_dtype_moves(device):
    a, x = _block(ROUTINGS[1], device, shared=True)
    state = a.state_dict()
    for name in ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale",
                 "w2_weight_scale_2"):
        assert name in state, sorted(state)
    g = torch.Generator().manual_seed(9)  # other weights of the same shapes, then a's state loaded in place
    b = FP4MoE.from_bf16(torch.randn(6, 64, generator=g).to(device=device, dtype=torch.bfloat16),
                         torch.randn(6, 64, 64, generator=g).to(device), torch.randn(6, 64, 32, generator=g).to(device),
                         ROUTINGS[1], shared_gate_up=torch.randn(64, 64, generator=g).to(device),
                         shared_down=torch.randn(64, 32, generator=g).to(device),
                         selection_bias=torch.zeros(6, device=device))
    b.load_state_dict(state)
    assert torch.equal(b(x), a(x))
    h = a.to(torch.float16)  # the experts keep their FP4 dtypes
    assert h.w13.data.dtype == torch.uint8 and h.w13.scales.dtype == torch.float8_e4m3fn
    assert h.w13.global_scale.dtype == torch.float32 and h.router_weight.dtype == torch.float16
    assert h.selection_bias.dtype == torch.float32  # selection runs on fp32 scores + bias


def test_block_builds_under_a_float64_default_dtype(device):
    block, x = _block(ROUTINGS[1], device, shared=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        again = FP4MoE(block.router_weight, block.w13, block.w2, block.routing, selection_bias=block.selection_bias)
    finally:
        torch.set_default_dtype(old)
    assert torch.equal(again(x), block(x))


LAYER_CASES = [
    dict(id="w4a4", routing=Routing("sigmoid_bias", top_k=2, routed_scaling_factor=2.5), mode="w4a4"),
    dict(id="mxfp4", routing=Routing("softmax", top_k=2), fmt="mxfp4"),
    dict(id="gpt_oss_interleaved_biases", routing=Routing("gpt_oss", top_k=2), fmt="mxfp4", activation="gpt_oss",
         interleaved=True, biases=True),
    dict(id="top_k_1_one_token", routing=Routing("softmax", top_k=1), tokens=1),
    dict(id="top_k_E", routing=Routing("softmax", top_k=6)),
]


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: c["id"])
def test_block_layer_variants_match_reference(case, device):
    g = torch.Generator().manual_seed(21)
    E, H, I, T = 6, 64, 32, case.get("tokens", 5)
    kw = dict(mode=case.get("mode", "w4a16"), activation=case.get("activation", "silu"),
              interleaved=case.get("interleaved", False))
    if case.get("biases"):
        kw["w13_bias"] = torch.randn(E, 2 * I, generator=g).to(device=device, dtype=torch.bfloat16)
        kw["w2_bias"] = torch.randn(E, H, generator=g).to(device=device, dtype=torch.bfloat16)
    if case["routing"].kind != "softmax":
        kw["selection_bias"] = (torch.randn(E, generator=g) * 0.1).to(device)
    block = FP4MoE.from_bf16(torch.randn(E, H, generator=g).to(device=device, dtype=torch.bfloat16),
                             torch.randn(E, 2 * I, H, generator=g).to(device), torch.randn(E, H, I, generator=g).to(device),
                             case["routing"], fmt=case.get("fmt", "nvfp4"), **kw)
    x = torch.randn(T, H, generator=g).to(device=device, dtype=torch.bfloat16)
    logits = torch.nn.functional.linear(x, block.router_weight)
    r = route_reference(logits, block.routing, block.selection_bias)
    ref = fp4_moe_reference(x, block.w13, block.w2, r.topk_ids, r.topk_weights, activation=block.activation,
                            interleaved=block.interleaved, w13_bias=block.w13_bias, w2_bias=block.w2_bias,
                            mode=block.mode)
    problem = guard.compare(block(x), ref, TOLERANCES["fp4_moe"])
    assert problem is None, problem
    assert torch.equal(block(x), block(x))  # deterministic


def test_block_with_no_tokens(device):
    block, x = _block(ROUTINGS[1], device, shared=True)
    assert block(x[:0]).shape == (0, 64)


def test_mxfp4_scales_outside_the_decodable_range_are_refused(device):
    """The fast decoder folds 2**100 into E8M0 scales: exponents beyond 2**27 would overflow."""
    import fp4moe

    w = fp4moe.quantize(torch.randn(32, 64) * 2.0**40, "mxfp4").to(device)
    with pytest.raises(ValueError, match=r"weight: MXFP4 scale exponents span .* decodes -106..27"):
        FP4Linear.from_fp4(w)
    FP4Linear.from_fp4(fp4moe.quantize(torch.randn(32, 64), "mxfp4").to(device))  # ordinary weights are fine


def test_block_traces_whole_under_torch_compile(device):
    """The experts are rebuilt from buffers on every call: dynamo must trace that without a graph
    break (aot_eager: no code generation, so it runs on CPU too; the GPU tests compile the ops)."""
    block, x = _block(ROUTINGS[1], device, shared=True)
    torch._dynamo.reset()
    out = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(out, block(x))
