"""MoE routing kernels against the torch reference, bit for bit; opportunistic expert activation.

Exactness: ids AND weights are compared bitwise (fp32 bits), on the interpreter and on the GPU.
The kernel and the reference run the same sequence of IEEE fp32 operations (fp4moe.ops.routing:
exp_f32, div_rn, sums in slot order), so no tolerance is needed anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

from fp4moe.models import PRESETS, Routing
from fp4moe.ops.routing import EXP_F32, RoutingConfig, exp_f32, route, route_reference


def assert_same_bits(out: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    """Bitwise equality (NaN == NaN of the same bits, -0 != +0), with the first mismatch shown."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, \
        f"{name}: {tuple(out.shape)}/{out.dtype} vs {tuple(ref.shape)}/{ref.dtype}"
    o, r = out.detach().cpu(), ref.detach().cpu()
    if o.dtype == torch.float32:
        o, r = o.view(torch.int32), r.view(torch.int32)
    diff = (o != r).nonzero()
    if len(diff):
        i = tuple(int(v) for v in diff[0])
        raise AssertionError(f"{name}: {len(diff)} of {o.numel()} differ; first at {i}: {out[i].item()!r} vs "
                             f"{ref[i].item()!r}")


def assert_same_routing(out, ref) -> None:
    assert_same_bits(out.topk_ids, ref.topk_ids, "topk_ids")
    assert_same_bits(out.topk_weights, ref.topk_weights, "topk_weights")
    assert not bool(out.nonfinite.any()), "nonfinite flagged on finite logits"
    if ref.stats is not None:
        assert out.stats is not None
        assert int(out.stats.active_experts) == int(ref.stats.active_experts)
        assert int(out.stats.exact_experts) == int(ref.stats.exact_experts)
        assert_same_bits(out.stats.kept_fraction, ref.stats.kept_fraction, "kept_fraction")


@dataclass(frozen=True)
class Case:
    routing: Routing
    E: int
    T: int
    dtype: torch.dtype
    bias: bool
    why: str


def _case_id(c: Case) -> str:
    r = c.routing
    grp = f"_g{r.n_group}of{r.topk_group}" if r.n_group > 1 else ""
    return f"{r.kind}_E{c.E}_k{r.top_k}{grp}_T{c.T}{'' if r.renormalize else '_norenorm'}"


CASES = [
    Case(Routing("softmax", top_k=2), 8, 5, torch.bfloat16, False, "Mixtral: E=8, top-2"),
    Case(Routing("softmax", top_k=8), 160, 33, torch.float32, False, "E not a power of two; T past a tile"),
    Case(Routing("softmax", top_k=8, renormalize=False), 160, 5, torch.float32, False,
         "no renormalisation: the full-softmax sum over all E, in expert order"),
    Case(Routing("softmax", top_k=1), 257, 1, torch.float16, False, "prime E, top-1, one token, fp16 logits"),
    Case(Routing("softmax", top_k=8), 8, 33, torch.bfloat16, False, "top-k = E"),
    Case(Routing("sigmoid_bias", top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5), 256, 33,
         torch.bfloat16, True, "DeepSeek-V3: 8 groups of 32, 4 kept"),
    Case(Routing("sigmoid_bias", top_k=6, routed_scaling_factor=2.827), 160, 5, torch.float32, True,
         "GLM-5-like, no groups; a scaling factor not exact in fp32"),
    Case(Routing("sigmoid_bias", top_k=257), 257, 5, torch.bfloat16, True, "prime E, top-k = E"),
    Case(Routing("sigmoid_bias", top_k=4, n_group=160, topk_group=4), 160, 5, torch.float32, True,
         "groups of one expert: a group's score is its only expert's"),
    Case(Routing("sigmoid_bias", top_k=2, renormalize=False, n_group=4, topk_group=2, routed_scaling_factor=1.5), 8,
         33, torch.float32, False, "no renormalisation, no bias, top-k over 2 of 4 groups"),
    Case(Routing("gpt_oss", top_k=4), 257, 33, torch.bfloat16, True, "gpt-oss with a logit bias, prime E"),
    Case(Routing("gpt_oss", top_k=8), 8, 5, torch.float32, False, "gpt-oss, top-k = E: softmax over all"),
]


def _inputs(case: Case, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 7919 + case.E * 31 + case.T)
    logits = (torch.randn(case.T, case.E, generator=g) * 2).to(device=device, dtype=case.dtype)
    bias = None
    if case.bias:
        # sigmoid_bias: a correction bias of the sigmoid's scale, so it reorders some experts
        bias = (torch.randn(case.E, generator=g) * (0.05 if case.routing.kind == "sigmoid_bias" else 1.0)).to(device)
    return logits, bias


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_routing_matches_reference_bitwise(case, device):
    logits, bias = _inputs(case, device)
    out = route(logits, case.routing, bias)
    assert out.topk_ids.dtype == torch.int32 and out.topk_weights.dtype == torch.float32
    assert out.topk_ids.shape == (case.T, case.routing.top_k)
    assert_same_routing(out, route_reference(logits, case.routing, bias))


@pytest.mark.parametrize("case", CASES[:1] + CASES[5:7] + CASES[10:11], ids=_case_id)
def test_oea_matches_reference_bitwise(case, device):
    logits, bias = _inputs(case, device, seed=1)
    k0 = max(1, case.routing.top_k // 2)
    assert_same_routing(route(logits, case.routing, bias, k0=k0), route_reference(logits, case.routing, bias, k0=k0))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # exp(95) = inf, on purpose
def test_exp_f32_kernel_equals_reference_and_is_accurate(device):
    """exp_f32 is a fixed op sequence: the kernel's bits equal the reference's over a sweep of
    fp32 values (every 2**-8 step in [-110, 95], randoms, and the edges), and it stays within
    1.2 ulp of the exact exponential where the result is a normal fp32."""
    import triton

    from fp4moe.kernels import routing as kr

    assert (kr._LOG2E.value, kr._LN2_HI.value, kr._LN2_LO.value, kr._EXP_LO.value, kr._EXP_HI.value) == (
        EXP_F32.log2e, EXP_F32.ln2_hi, EXP_F32.ln2_lo, EXP_F32.lo, EXP_F32.hi)
    assert (1.0, 1.0, kr._C2.value, kr._C3.value, kr._C4.value, kr._C5.value, kr._C6.value,
            kr._C7.value) == EXP_F32.coefficients
    assert (kr._FLT_MIN.value, kr._SUM_EPS.value) == (EXP_F32.flt_min, EXP_F32.sum_eps)
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.arange(-110 * 256, 95 * 256) / 256.0, torch.randn(20000, generator=g) * 30,
                   torch.tensor([0.0, -0.0, 88.72, 88.7228, 88.73, -87.33, -87.34, -103.9, -104.5, 89.5, 1e-30])])
    x = x.to(torch.float32)
    y = torch.empty_like(x, device=device)
    xd = x.to(device)
    kr.exp_f32_kernel[(triton.cdiv(x.numel(), 1024),)](xd, y, x.numel(), BLOCK=1024, enable_fp_fusion=False,
                                                        enable_reflect_ftz=False)
    ref = exp_f32(x)
    assert_same_bits(y.cpu(), ref, "exp_f32")
    exact = torch.exp(x.double())
    normal = (exact >= 2.0 ** -126) & (exact <= torch.finfo(torch.float32).max)
    e32 = exact[normal].float()
    ulp = (torch.nextafter(e32, torch.full_like(e32, math.inf)) - e32).double()  # fp32 ulp at the result
    assert float(((ref[normal].double() - exact[normal]).abs() / ulp).max()) <= 1.2
    assert bool((ref[exact < 2.0 ** -126] == 0).all()) and bool(torch.isinf(ref[exact > 3.5e38]).all())


def test_ties_resolved_by_lowest_expert_id(device):
    # all-equal logits: every expert ties, so the k lowest ids, in order
    for routing in (Routing("softmax", top_k=3), Routing("gpt_oss", top_k=3),
                    Routing("sigmoid_bias", top_k=3, n_group=4, topk_group=2)):
        logits = torch.zeros(4, 12, device=device)
        out = route(logits, routing)
        assert out.topk_ids.tolist() == [[0, 1, 2]] * 4, routing
        assert_same_routing(out, route_reference(logits, routing))
    # many partial ties (logits in {0, 1, 2}), bf16; the order is descending score, ties by id
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 3, (33, 160), generator=g).to(device=device, dtype=torch.bfloat16)
    routing = Routing("softmax", top_k=8)
    out = route(logits, routing)
    assert_same_routing(out, route_reference(logits, routing))
    score = logits.float().gather(1, out.topk_ids.long())
    ids = out.topk_ids
    assert bool((score[:, 1:] <= score[:, :-1]).all())
    assert bool(((score[:, 1:] < score[:, :-1]) | (ids[:, 1:] > ids[:, :-1])).all())
    # signed zeros tie (-0.0 == +0.0): lowest id first, not +0.0 first
    logits = torch.tensor([[-0.0, 0.0, -0.0, 0.0, -1.0, -2.0]], device=device)
    for routing in (Routing("softmax", top_k=3), Routing("gpt_oss", top_k=3)):
        out = route(logits, routing)
        assert out.topk_ids.tolist() == [[0, 1, 2]]
        assert_same_routing(out, route_reference(logits, routing))
    # a group tie: groups 1 and 2 score the same; group 1 (lower id) is kept
    logits = torch.full((1, 8), -5.0, device=device)
    logits[0, 2:6] = 3.0  # groups of 2: g1 = {2, 3}, g2 = {4, 5}
    out = route(logits, Routing("sigmoid_bias", top_k=2, n_group=4, topk_group=1))
    assert out.topk_ids.tolist() == [[2, 3]]


def test_block_sizes_do_not_change_bits(device):
    case = CASES[5]
    logits, bias = _inputs(case, device)
    ref = route(logits, case.routing, bias, config=RoutingConfig(block_t=1, num_warps=2))
    for cfg in (RoutingConfig(4, 4), RoutingConfig(16, 4)):
        assert_same_routing(route(logits, case.routing, bias, config=cfg), ref)


@pytest.mark.slow  # cross-compilation or many interpreter runs: .ci/run runs it
def test_determinism(device):
    case = CASES[5]
    logits, bias = _inputs(case, device)
    for k0 in (None, 3):
        a = route(logits, case.routing, bias, k0=k0)
        b = route(logits, case.routing, bias, k0=k0)
        assert_same_routing(a, b)


def test_non_contiguous_logits(device):
    logits = torch.randn(16, 6, device=device).t()  # [6, 16] with column stride 6
    routing = Routing("softmax", top_k=4)
    assert_same_routing(route(logits, routing), route_reference(logits, routing))


def test_zero_tokens(device):
    routing = Routing("sigmoid_bias", top_k=8, routed_scaling_factor=2.5)
    logits = torch.randn(0, 256, device=device)
    out = route(logits, routing, check_finite=True)
    assert out.topk_ids.shape == (0, 8) and out.topk_weights.shape == (0, 8) and out.nonfinite.shape == (0,)
    oea = route(logits, routing, k0=4)
    assert oea.stats.kept_fraction.shape == (0,) and int(oea.stats.active_experts) == 0


# ------------------------------------------------------------------------------ NaN / Inf


def test_nonfinite_logits(device):
    routing = Routing("sigmoid_bias", top_k=4, routed_scaling_factor=2.5)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 40, generator=g).to(device)
    bad = logits.clone()
    bad[3, 7] = float("nan")
    bad[5, 0] = float("inf")
    with pytest.raises(ValueError, match=r"logits: NaN/Inf in router logits \(first at token 3, expert 7"):
        route_reference(bad, routing)
    with pytest.raises(ValueError, match=r"logits: NaN/Inf in router logits at token 3.*2 of 6 tokens"):
        route(bad, routing, check_finite=True)
    if device == "cpu":  # torch._assert_async raises at once on CPU; on a GPU its device-side assertion
        # would leave the CUDA context unusable for every later test (test_gpu_cuda_graph_routing_and_dispatch
        # runs "async" on finite logits under capture)
        with pytest.raises(RuntimeError, match="NaN/Inf"):
            route(bad, routing, check_finite="async")
    out = route(bad, routing)  # unchecked: the bad tokens are flagged and weigh NaN, the others are exact
    assert out.nonfinite.tolist() == [0, 0, 0, 1, 0, 1]
    assert bool(out.topk_weights[[3, 5]].isnan().all())
    assert bool(((out.topk_ids >= 0) & (out.topk_ids < 40)).all())  # still valid ids for dispatch
    good = [0, 1, 2, 4]
    ref = route_reference(logits[good], routing)
    assert_same_bits(out.topk_ids[good], ref.topk_ids, "topk_ids")
    assert_same_bits(out.topk_weights[good], ref.topk_weights, "topk_weights")
    bias = torch.zeros(40, device=device)
    bias[1] = float("nan")
    assert route(logits, routing, bias).nonfinite.tolist() == [1] * 6
    with pytest.raises(ValueError, match="bias: NaN/Inf"):
        route_reference(logits, routing, bias)


@pytest.mark.parametrize("kind", ["softmax", "sigmoid_bias"])
def test_nonfinite_token_leaves_oea_of_the_others_alone(device, kind):
    """A NaN token is routed as if its logits were 0 (experts 0..k0-1 by the tie rule): with OEA
    it must neither open those experts to the other tokens nor count in the statistics."""
    routing = Routing(kind, top_k=4)
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 24, generator=g).to(device) + 3.0  # experts 0, 1 never the others' own picks
    logits[:, :2] -= 20.0
    bad = torch.cat([logits[:2], torch.full_like(logits[:1], float("nan")), logits[2:]])
    out = route(bad, routing, k0=2)
    ref = route_reference(logits, routing, k0=2)
    good = [0, 1, 3, 4, 5]
    assert out.nonfinite.tolist() == [0, 0, 1, 0, 0, 0]
    assert_same_bits(out.topk_ids[good], ref.topk_ids, "topk_ids")
    assert_same_bits(out.topk_weights[good], ref.topk_weights, "topk_weights")
    assert int(out.stats.active_experts) == int(ref.stats.active_experts)
    assert int(out.stats.exact_experts) == int(ref.stats.exact_experts)
    assert math.isnan(float(out.stats.kept_fraction[2]))
    assert float(out.stats.mean_kept_fraction()) == float(ref.stats.kept_fraction.mean())


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's numpy adds 3e38 + 1e38
def test_gpt_oss_selection_overflow_is_nonfinite(device):
    routing = Routing("gpt_oss", top_k=2)
    logits = torch.tensor([[3e38, 1.0, 0.0, -1.0], [0.5, 1.0, 0.0, -1.0]], device=device)
    bias = torch.tensor([1e38, 0.0, 0.0, 0.0], device=device)
    out = route(logits, routing, bias)
    assert out.nonfinite.tolist() == [1, 0]
    assert bool(out.topk_weights[0].isnan().all()) and not bool(out.topk_weights[1].isnan().any())
    ref = route_reference(logits[1:], routing, bias)
    assert_same_bits(out.topk_weights[1:], ref.topk_weights, "topk_weights")
    with pytest.raises(ValueError, match=r"logits \+ bias: the selection score overflows fp32 \(first at token 0"):
        route_reference(logits, routing, bias)
    with pytest.raises(ValueError, match="NaN/Inf in router logits at token 0"):
        route(logits, routing, bias, check_finite=True)


def test_bad_inputs(device):
    x = torch.randn(4, 16, device=device)
    r = Routing("sigmoid_bias", top_k=4, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match=r"logits: expected a 2-D tensor \[T, E\], got shape \(16,\)"):
        route(x[0], r)
    with pytest.raises(TypeError, match="logits: expected float32, bfloat16 or float16, got torch.int32"):
        route(x.int(), r)
    with pytest.raises(ValueError, match=r"routing.top_k: expected 1..E=16, got 17"):
        route(x, replace(r, top_k=17))
    with pytest.raises(ValueError, match="routing.n_group: expected a divisor of E=16, got 3"):
        route(x, replace(r, n_group=3))
    with pytest.raises(ValueError, match="routing.topk_group: expected 1..n_group=4, got 5"):
        route(x, replace(r, topk_group=5))
    with pytest.raises(ValueError, match=r"routing.top_k: expected <= topk_group \* E / n_group = 8"):
        route(x, replace(r, top_k=9))
    with pytest.raises(ValueError, match="routing.n_group: grouped top-k is implemented for 'sigmoid_bias' only"):
        route(x, Routing("softmax", top_k=2, n_group=2))
    with pytest.raises(ValueError, match="routing.topk_group: grouped top-k is implemented for 'sigmoid_bias' only"):
        route(x, Routing("gpt_oss", top_k=2, topk_group=2))
    with pytest.raises(ValueError, match="routing.routed_scaling_factor: expected 1.0 for 'gpt_oss'"):
        route(x, Routing("gpt_oss", top_k=2, routed_scaling_factor=2.0))
    with pytest.raises(ValueError, match="bias: 'softmax' routing takes no bias"):
        route(x, Routing("softmax", top_k=2), torch.zeros(16, device=device))
    with pytest.raises(ValueError, match=r"bias: expected shape \(16,\) \(one per expert\), got \(8,\)"):
        route(x, r, torch.zeros(8, device=device))
    with pytest.raises(ValueError, match="k0: expected an int in 1..top_k=4, got 5"):
        route(x, r, k0=5)
    with pytest.raises(ValueError, match="k0: expected an int in 1..top_k=4, got 0"):
        route(x, r, k0=0)
    with pytest.raises(ValueError, match="logits: expected 1..1024 experts"):
        route(torch.zeros(1, 1025, device=device), Routing("softmax", top_k=1))
    with pytest.raises(ValueError, match="check_finite: expected False, True or 'async'"):
        route(x, r, check_finite="yes")
    with pytest.raises(ValueError, match="RoutingConfig.block_t"):
        RoutingConfig(3, 4)


def test_presets_route(device):
    """Every model preset's routing runs at its real E and k and matches the reference."""
    g = torch.Generator().manual_seed(11)
    for name, model in PRESETS.items():
        logits = torch.randn(5, model.n_experts, generator=g).to(device=device, dtype=torch.bfloat16)
        bias = (torch.randn(model.n_experts, generator=g) * 0.05).to(device) \
            if model.routing.kind == "sigmoid_bias" else None
        assert_same_routing(route(logits, model.routing, bias), route_reference(logits, model.routing, bias))


# ------------------------------------------------------------------------------ OEA invariants


def _oea_invariants(logits, routing, bias, k0, out, exact):
    """The properties OEA promises, checked from the outputs alone (no reference routing)."""
    T, k = out.topk_ids.shape
    ids, w = out.topk_ids.cpu(), out.topk_weights.cpu()
    exact_ids = exact.topk_ids.cpu()
    # 1. each token keeps its own top-k0, in order
    assert torch.equal(ids[:, :k0], exact_ids[:, :k0])
    # 2. every extra expert is in the active set (the union of the top-k0s); empty slots at the end
    active = set(exact_ids[:, :k0].flatten().tolist())
    for t in range(T):
        row = ids[t].tolist()
        valid = [e for e in row if e >= 0]
        assert row == valid + [-1] * (k - len(valid)), row
        assert len(set(valid)) == len(valid)
        assert set(valid[k0:]) <= active
    # 3. weights renormalised as the base routing does; empty slots weigh 0
    assert bool((w[ids < 0] == 0).all())
    target = routing.routed_scaling_factor if routing.kind == "sigmoid_bias" else 1.0
    if routing.renormalize or routing.kind == "gpt_oss":
        assert torch.allclose(w.double().sum(1), torch.full((T,), target, dtype=torch.float64), rtol=0, atol=1e-6 * k)
    # 4. unique experts: OEA's = the active set <= exact routing's; the stats say so
    n_oea = len(set(ids[ids >= 0].tolist()))
    n_exact = len(set(exact_ids.flatten().tolist()))
    assert n_oea == len(active) <= n_exact
    assert int(out.stats.active_experts) == n_oea and int(out.stats.exact_experts) == n_exact
    # 5. kept fraction, recomputed in float64 from the definition (routing mass before renormalising)
    x = logits.double().cpu()
    if routing.kind == "sigmoid_bias":
        mass = torch.sigmoid(x)
    else:
        xb = x + bias.double().cpu() if bias is not None else x
        mass = torch.softmax(xb, dim=1)
    kept = torch.where(ids >= 0, mass.gather(1, ids.clamp(min=0).long()), 0).sum(1) / mass.gather(
        1, exact_ids.long()).sum(1)
    assert torch.allclose(out.stats.kept_fraction.double().cpu(), kept, rtol=1e-5, atol=0)
    if routing.kind != "sigmoid_bias":
        assert bool((kept <= 1 + 1e-6).all())
    # 6. fills are the token's best remaining active experts (by its selection score)
    sel = x if routing.kind == "softmax" else (torch.sigmoid(x) if routing.kind == "sigmoid_bias" else x)
    if bias is not None:
        sel = sel + bias.double().cpu()
    act = torch.zeros(x.shape[1], dtype=torch.bool)
    act[list(active)] = True
    for t in range(T):
        row = [e for e in ids[t].tolist() if e >= 0]
        rest = act.clone()
        rest[row] = False
        if routing.kind == "sigmoid_bias" and routing.n_group > 1:
            rest &= _eligible_groups(sel[t], routing)
        if len(row) < k:
            assert not bool(rest.any()), f"token {t} left slots empty with active experts unused"
        elif len(row) > k0 and bool(rest.any()):
            assert float(sel[t, rest].max()) <= float(sel[t, row[k0:]].min()) + 1e-6


def _eligible_groups(sel_t, routing):
    E = sel_t.shape[0]
    groups = sel_t.view(routing.n_group, -1).sort(dim=1, descending=True).values[:, :2].sum(1)
    keep = groups.sort(descending=True, stable=True).indices[: routing.topk_group]
    ok = torch.zeros(routing.n_group, dtype=torch.bool)
    ok[keep] = True
    return ok.repeat_interleave(E // routing.n_group)


def _oea_batches(E: int, T: int, device: str):
    g = torch.Generator().manual_seed(E + T)
    random = torch.randn(T, E, generator=g)
    same = random[:1].expand(T, E).clone()  # identical tokens: the active set is one token's top-k0
    disjoint = torch.full((T, E), -4.0)  # token t prefers experts t*4 .. t*4+3 (mod E): a large active set
    for t in range(T):
        disjoint[t, [(4 * t + j) % E for j in range(4)]] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    disjoint += torch.randn(T, E, generator=g) * 0.1
    return {"random": random.to(device), "identical_tokens": same.to(device), "disjoint": disjoint.to(device),
            "one_token": random[:1].to(device)}


@pytest.mark.parametrize("routing", [
    Routing("softmax", top_k=8),
    Routing("sigmoid_bias", top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5),
    Routing("sigmoid_bias", top_k=6, routed_scaling_factor=2.5),
    Routing("gpt_oss", top_k=4),
], ids=lambda r: f"{r.kind}_k{r.top_k}_g{r.n_group}")
@pytest.mark.slow  # cross-compilation or many interpreter runs: .ci/run runs it
def test_oea_invariants(routing, device):
    E, T = 64, 16
    g = torch.Generator().manual_seed(2)
    bias = (torch.randn(E, generator=g) * 0.05).to(device) if routing.kind != "softmax" else None
    k0 = routing.top_k // 2
    for name, logits in _oea_batches(E, T, device).items():
        out = route(logits, routing, bias, k0=k0)
        exact = route(logits, routing, bias)
        try:
            _oea_invariants(logits, routing, bias, k0, out, exact)
            assert_same_routing(out, route_reference(logits, routing, bias, k0=k0))
        except AssertionError as err:
            raise AssertionError(f"batch {name!r}: {err}") from err
        if name == "one_token":  # nobody else activated anything: the token keeps only its k0
            assert int((out.topk_ids >= 0).sum()) == k0
        if name == "identical_tokens":
            assert int(out.stats.active_experts) == k0 and int(out.stats.exact_experts) == routing.top_k


def test_make_router_for_the_benchmark(device):
    from fp4moe.ops.routing import make_router

    run = make_router(PRESETS["qwen3-30b-a3b"])
    logits = torch.randn(8, 128, device=device)
    ids, w, stats = run(logits)
    assert ids.shape == (8, 8) and stats is None
    ids, w, stats = run(logits, 4)
    summary = stats.summary()
    assert summary["active_experts"] == len(set(ids[ids >= 0].tolist())) <= summary["exact_experts"]
    assert stats.get("kept_weight") == pytest.approx(float(stats.kept_fraction.mean()))


def test_oea_with_k0_equal_k_is_exact_routing(device):
    routing = Routing("softmax", top_k=4)
    logits = torch.randn(9, 24, device=device)
    oea, exact = route(logits, routing, k0=4), route(logits, routing)
    assert_same_bits(oea.topk_ids, exact.topk_ids, "topk_ids")
    assert_same_bits(oea.topk_weights, exact.topk_weights, "topk_weights")
    assert bool((oea.stats.kept_fraction == 1).all())


def test_oea_reduces_unique_experts_at_decode_batch(device):
    """Qwen3-30B-A3B shape at batch 16 (the paper's setting), k0 = 4: fewer unique experts."""
    routing = PRESETS["qwen3-30b-a3b"].routing
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(16, 128, generator=g).to(device)
    out = route(logits, routing, k0=4)
    assert int(out.stats.active_experts) < int(out.stats.exact_experts)
    assert 0.5 < float(out.stats.mean_kept_fraction()) <= 1.0


# ------------------------------------------------------------------------------ cross-compilation


def test_cross_compile_default_configs():
    """The heuristic configurations compile for SM80, SM90 and SM120 without spilling."""
    from fp4moe.ops.routing import compile_requests
    from fp4moe.plan.crosscompile import cross_compile

    requests = []
    for name, ccs in (("glm-5", (80, 90, 120)), ("deepseek-v3", (90, 120)), ("qwen3-30b-a3b", (120,)),
                      ("gpt-oss-120b", (90,))):
        model = PRESETS[name]
        cfg = RoutingConfig.from_heuristic(4096, model.n_experts, model.routing.top_k)
        for cc in ccs:
            requests += compile_requests(model.routing, model.n_experts, cfg, cc, k0=4 if cc == 90 else None)
    cfg = RoutingConfig.from_heuristic(4096, 1024, 8)
    requests += compile_requests(Routing("softmax", top_k=8, renormalize=False), 1024, cfg, 90)
    for req, r in zip(requests, cross_compile(requests)):
        assert r.ok, f"sm{req.cc} {req.constexprs}: {r.error}"
        assert r.spill_bytes == 0, f"sm{req.cc} {req.constexprs}: spills {r.spill_bytes} B"


# ------------------------------------------------------------------------------ GPU


GPU_CASES = [
    ("glm-5", Routing("sigmoid_bias", top_k=8, routed_scaling_factor=2.5), 256),
    ("deepseek-v3", Routing("sigmoid_bias", top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5), 256),
    ("qwen3-30b-a3b", Routing("softmax", top_k=8), 128),
    ("qwen2-style", Routing("softmax", top_k=8, renormalize=False), 160),
    ("gpt-oss-120b", Routing("gpt_oss", top_k=4), 128),
    ("E512", Routing("softmax", top_k=8), 512),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,routing,E", GPU_CASES, ids=[c[0] for c in GPU_CASES])
@pytest.mark.parametrize("T", [1, 16, 4096])
def test_gpu_real_sizes_bitwise(name, routing, E, T):
    g = torch.Generator().manual_seed(T + E)
    logits = (torch.randn(T, E, generator=g) * 2).to("cuda", torch.bfloat16)
    bias = (torch.randn(E, generator=g) * 0.05).cuda() if routing.kind != "softmax" else None
    for k0 in (None, routing.top_k // 2):
        out = route(logits, routing, bias, k0=k0)
        ref_gpu = route_reference(logits, routing, bias, k0=k0)
        assert_same_routing(out, ref_gpu)
        # the same bits on the CPU: the numerics do not depend on the backend
        assert_same_routing(out, route_reference(logits.cpu(), routing, bias.cpu() if bias is not None else None,
                                                 k0=k0))


@pytest.mark.gpu
def test_gpu_cuda_graph_routing_and_dispatch():
    from fp4moe.ops.dispatch import dispatch, dispatch_reference

    routing = PRESETS["glm-5"].routing
    T, E = 64, 256
    bias = (torch.randn(E) * 0.05).cuda()
    static_logits = torch.randn(T, E, device="cuda", dtype=torch.bfloat16)
    for k0 in (None, 4):
        route(static_logits, routing, bias, k0=k0, check_finite=True)  # warm-up (compiles) outside capture
        dispatch(route(static_logits, routing, bias, k0=k0).topk_ids, E, 16)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = route(static_logits, routing, bias, k0=k0, check_finite="async")
            plan = dispatch(out.topk_ids, E, 16)
        new = torch.randn(T, E, device="cuda", dtype=torch.bfloat16)
        static_logits.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        ref = route_reference(new, routing, bias, k0=k0)
        assert_same_routing(out, ref)
        ref_plan = dispatch_reference(ref.topk_ids, E, 16)
        assert torch.equal(plan.sorted_pair, ref_plan.sorted_pair)
        assert torch.equal(plan.tiles.tile_expert, ref_plan.tiles.tile_expert)
        assert torch.equal(plan.tiles.n_tiles, ref_plan.tiles.n_tiles)


@pytest.mark.gpu
def test_gpu_torch_compile():
    routing = PRESETS["deepseek-v3"].routing
    bias = (torch.randn(256) * 0.05).cuda()
    logits = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)

    def f(x):
        r = route(x, routing, bias, k0=4)
        return r.topk_ids, r.topk_weights, r.stats.kept_fraction

    ids, w, kept = torch.compile(f, fullgraph=True)(logits)
    ref = route_reference(logits, routing, bias, k0=4)
    assert_same_bits(ids, ref.topk_ids, "topk_ids")
    assert_same_bits(w, ref.topk_weights, "topk_weights")
    assert_same_bits(kept, ref.stats.kept_fraction, "kept_fraction")


def test_routing_fields_are_checked_at_construction():
    for kwargs, field in [(dict(top_k=2.0), "top_k"), (dict(top_k=True), "top_k"), (dict(top_k=0), "top_k"),
                          (dict(top_k=2, n_group=0), "n_group"), (dict(top_k=2, topk_group=1.5), "topk_group"),
                          (dict(top_k=2, renormalize=1), "renormalize"),
                          (dict(top_k=2, routed_scaling_factor=float("nan")), "routed_scaling_factor"),
                          (dict(top_k=2, routed_scaling_factor=-1.0), "routed_scaling_factor")]:
        with pytest.raises(ValueError, match=rf"Routing\.{field}: expected"):
            Routing("sigmoid_bias", **kwargs)
    with pytest.raises(ValueError, match="Routing.kind: expected"):
        Routing("topk", top_k=2)
    assert Routing("sigmoid_bias", top_k=8, routed_scaling_factor=2).routed_scaling_factor == 2
