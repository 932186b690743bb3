"""fp4moe.graphs: modules replay a graph of their own call where a shape repeats.

On CPU the graph is ``RerunGraph`` (the call run again on the static buffers, which is what a
CUDA-graph replay does), so the caching logic is tested here without a GPU; the GPU tests capture
real CUDA graphs and compare them with eager calls bit for bit.
"""

import copy
import io
import warnings

import pytest
import torch

from fp4moe.graphs import CallGraphs, GraphPolicy, current_graph_policy, eager_calls, graph_policy, set_graph_policy
from fp4moe.models import Routing
from fp4moe.nn import FP4Linear, FP4MoE
from fp4moe.tuning import tuning

SIGMOID = Routing("sigmoid_bias", top_k=2, n_group=2, topk_group=1, routed_scaling_factor=2.5)


pytestmark = pytest.mark.usefixtures("fresh_guard")


@pytest.fixture
def graphs_here(device):
    """Graphs on the device the tests run on (CPU: RerunGraph)."""
    with graph_policy(devices={"cuda", device}):
        yield


def _block(device, *, shared=True, k0=None, check_finite=False, E=6, H=64, I=32):
    g = torch.Generator().manual_seed(5)
    router = torch.randn(E, H, generator=g).to(device=device, dtype=torch.bfloat16)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    sgu = torch.randn(2 * I, H, generator=g).to(device) if shared else None
    sd = torch.randn(H, I, generator=g).to(device) if shared else None
    return FP4MoE.from_bf16(router, w13.to(device), w2.to(device), SIGMOID, shared_gate_up=sgu, shared_down=sd,
                            selection_bias=(torch.randn(E, generator=g) * 0.1).to(device), k0=k0,
                            check_finite=check_finite)


def _inputs(device, n, T=5, H=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, H, generator=g).to(device=device, dtype=torch.bfloat16) for _ in range(n)]


def _graphs(module) -> CallGraphs:
    return module.__dict__["_graphs"]


def _call(module, x, times: int = 3):
    """``times`` calls of ``module`` on ``x`` (3: the first eager, the second captured, the third a
    replay); the last output."""
    for _ in range(times):
        out = module(x)
    return out


def test_policy_validation_and_override():
    with pytest.raises(ValueError, match="warmup_calls"):
        GraphPolicy(warmup_calls=0)
    with pytest.raises(ValueError, match="max_tokens"):
        GraphPolicy(max_tokens=-1)
    with pytest.raises(TypeError, match="GraphPolicy"):
        set_graph_policy("off")
    before = current_graph_policy()
    with graph_policy(enabled=False) as p:
        assert p.enabled is False and current_graph_policy() is p
    assert current_graph_policy() is before


@torch.no_grad()
def test_moe_replay_equals_eager(device, graphs_here):
    """Third call of a shape replays; every call equals the eager call bit for bit; OEA statistics
    come from the graph."""
    block = _block(device, k0=1)
    xs = _inputs(device, 4)
    with graph_policy(enabled=False):
        want = [block(x) for x in xs]
        want_stats = block.last_stats.summary()
    got = [block(x) for x in xs]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    gr = _graphs(block)
    assert (gr.captures, gr.replays, len(gr)) == (1, 2, 1)
    assert block.last_stats.summary() == want_stats
    # the returned tensor is a copy: a later call does not change it
    kept = got[-1].clone()
    block(xs[0])
    assert torch.equal(got[-1], kept)


@torch.no_grad()
def test_linear_replay_equals_eager(device, graphs_here):
    g = torch.Generator().manual_seed(1)
    layer = FP4Linear.from_linear(torch.nn.Linear(64, 48).to(device))
    xs = [torch.randn(2, 3, 64, generator=g).to(device=device, dtype=torch.bfloat16) for _ in range(3)]
    with graph_policy(enabled=False):
        want = [layer(x) for x in xs]
    got = [layer(x) for x in xs]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _graphs(layer).replays == 1


@torch.no_grad()
def test_weights_written_in_place_drop_the_graphs(device, graphs_here):
    """load_state_dict copies into the buffers: the graph (and the packed weights it read) must not
    survive it."""
    block = _block(device)
    other = _block(device)
    with torch.no_grad():
        other.w13_weight.copy_(torch.flip(other.w13_weight, dims=(0,)))
        other.router_weight.mul_(-1)
    x = _inputs(device, 1)[0]
    _call(block, x)
    assert _graphs(block).replays == 1
    block.load_state_dict(other.state_dict())
    with graph_policy(enabled=False):
        want = other(x)
    assert torch.equal(block(x), want)
    assert len(_graphs(block)) == 0  # dropped, not replayed


@torch.no_grad()
def test_a_replaced_submodule_or_buffer_drops_the_graphs(device, graphs_here):
    """A shared expert swapped for another module, or a buffer rebound to a new tensor (no write to
    the old one): the graphs read the old ones and must go."""
    block, x = _block(device), _inputs(device, 1)[0]
    _call(block, x)
    assert _graphs(block).replays == 1
    other = _block(device, shared=True)
    with torch.no_grad():
        other.shared_down.weight_scale_2.mul_(2)  # a different shared expert
    block.shared_down = other.shared_down
    with graph_policy(enabled=False):
        want = block(x)
    assert torch.equal(block(x), want) and len(_graphs(block)) == 0
    _call(block, x)
    block.router_weight = -block.router_weight
    with graph_policy(enabled=False):
        want = block(x)
    assert torch.equal(block(x), want) and len(_graphs(block)) == 0


@torch.no_grad()
def test_device_or_dtype_change_drops_the_graphs(device, graphs_here):
    block = _block(device, shared=False)
    x = _inputs(device, 1)[0]
    _call(block, x)
    assert len(_graphs(block)) == 1
    block.to(device)  # _apply: every cached decision made again
    assert len(_graphs(block)) == 0
    block.half()  # the FP4 buffers keep their dtypes; the router follows
    assert block.router_weight.dtype == torch.float16
    xh = x.half()
    with graph_policy(enabled=False):
        want = block(xh)
    before = _graphs(block).replays
    got = _call(block, xh)
    assert torch.equal(got, want) and _graphs(block).replays == before + 1


@torch.no_grad()
def test_settings_are_part_of_the_key(device, graphs_here):
    block = _block(device, shared=False)
    x = _inputs(device, 1)[0]
    _call(block, x)
    block.k0 = 1
    with graph_policy(enabled=False):
        want = block(x)
    assert torch.equal(block(x), want)
    assert _graphs(block).replays == 1  # the k0 = 1 call was a new shape of call, run eagerly


@torch.no_grad()
def test_tuning_is_part_of_the_key(device, graphs_here):
    """A graph captured under one tuning record is not replayed under another (a tuning change may
    change which kernels run): the call under the new record is a new shape of call, run eagerly;
    back under the first record, its graph replays."""
    block = _block(device, shared=False)
    x = _inputs(device, 1)[0]
    _call(block, x)
    assert _graphs(block).replays == 1
    with tuning(moe=dict(fused_swiglu=False), dispatch=dict(tiles_per_program=16)):
        with graph_policy(enabled=False):
            want = block(x)
        assert torch.equal(block(x), want)
        assert _graphs(block).replays == 1  # no replay of the graph captured under the defaults
    assert torch.equal(block(x), want) and _graphs(block).replays == 2


def test_no_graph_when_not_allowed(device, graphs_here):
    """Grad recording, check_finite=True, large calls, nested calls and an eager_calls block stay
    eager."""
    x = _inputs(device, 1)[0]
    block = _block(device, shared=True)
    _call(block, x)  # grad enabled, but nothing requires grad: graphs allowed
    assert len(_graphs(block)) == 1
    xg = x.clone().requires_grad_(True)
    _call(block, xg)
    assert len(_graphs(block)) == 1  # the requires-grad input never captured
    # the shared expert's linears ran inside the block's calls only: no graphs of their own
    assert len(_graphs(block.shared_gate_up)) == 0 and len(_graphs(block.shared_down)) == 0
    with torch.no_grad():
        strict = _block(device, shared=False, check_finite=True)
        _call(strict, x)
        assert len(_graphs(strict)) == 0
        with graph_policy(max_tokens=4):
            _call(block, _inputs(device, 1, T=6)[0])
        assert len(_graphs(block)) == 1
        with eager_calls():
            _call(block, _inputs(device, 1, T=3)[0])
        assert len(_graphs(block)) == 1


@torch.no_grad()
def test_lru_bound_and_copies(device, graphs_here):
    block = _block(device, shared=False)
    with graph_policy(max_graphs=2):
        for T in (1, 2, 3):
            for _ in range(2):
                block(_inputs(device, 1, T=T)[0])
        assert len(_graphs(block)) == 2
    twin = copy.deepcopy(block)
    assert len(_graphs(twin)) == 0 and len(_graphs(block)) == 2
    buf = io.BytesIO()
    torch.save(block, buf)
    buf.seek(0)
    clone = torch.load(buf, weights_only=False)
    assert len(_graphs(clone)) == 0


@torch.no_grad()
def test_capture_failure_warns_and_stays_eager(device, graphs_here):
    """A call that cannot be captured runs eagerly for that shape, with one warning."""
    layer = FP4Linear.from_linear(torch.nn.Linear(64, 32).to(device))
    x = _inputs(device, 1, T=2)[0]
    calls = {"n": 0}
    real = layer._forward_graphable

    def flaky(x):
        calls["n"] += 1
        if calls["n"] == 3:  # the capture (after the first call and the warm-up)
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(x)

    layer._forward_graphable = flaky
    layer(x)
    with pytest.warns(RuntimeWarning, match="could not capture"):
        layer(x)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        layer(x)
    assert not [w for w in seen if "could not capture" in str(w.message)]
    assert len(_graphs(layer)) == 0


@pytest.mark.gpu
@torch.no_grad()
def test_cuda_graphs_bitwise_and_inside_a_callers_capture():
    """On the GPU: replays equal eager calls bit for bit at decode sizes; inside a caller's capture
    the module adds its kernels to the caller's graph."""
    block = _block("cuda", E=16, H=256, I=128, k0=None)
    for T in (1, 4, 16):
        xs = _inputs("cuda", 4, T=T, H=256, seed=T)
        with graph_policy(enabled=False):
            want = [block(x) for x in xs]
        got = [block(x) for x in xs]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), T
    assert _graphs(block).replays >= 6
    x = _inputs("cuda", 1, T=8, H=256, seed=9)[0]
    block(x)
    block(x)  # captured
    n = _graphs(block).captures
    g = torch.cuda.CUDAGraph()
    static = x.clone()
    with torch.cuda.graph(g):
        out = block(static)
    g.replay()
    torch.cuda.synchronize()
    with graph_policy(enabled=False):
        assert torch.equal(out, block(x))
    assert _graphs(block).captures == n


def test_eager_calls_skip_the_custom_op_only_where_nothing_traces():
    """ops._direct.runs_direct: plain tensors run the implementation directly; a dispatch mode
    (FakeTensorMode: torch.compile's and export's tracing), a tensor subclass or autograd recording
    keep the custom op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp4moe.ops._direct import runs_direct

    x = torch.randn(2, 4)
    assert runs_direct(x, None, torch.nn.Parameter(torch.ones(1), requires_grad=False))
    with FakeTensorMode():
        assert not runs_direct(torch.empty(2))
    assert not runs_direct(x.requires_grad_(True))
    with torch.no_grad():
        assert runs_direct(x)
