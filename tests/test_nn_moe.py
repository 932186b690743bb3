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
    sgu = torch.randn(2 * I, H, generator=g) if shared else None
    sd = torch.randn(H, I, generator=g) if shared else None
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
