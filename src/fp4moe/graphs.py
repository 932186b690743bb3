"""CUDA graphs of a module's own calls, per input shape: a plain call costs one graph launch.

A plain (eager) call of ``FP4MoE`` runs ~10 kernels and, before each, Python work that depends only
on the weights and the token count (checks, configuration, the dispatch plan's sizes, Triton's
argument binding). Where a shape repeats (every decode step of a model calls each layer with the
same token count) that work is done once: :class:`CallGraphs` captures the module's call into a CUDA
graph the second time it sees a shape, and later calls of that shape copy the input into the graph's
static input, replay the graph and return a copy of its static output. Numerics are those of the
eager call (the graph replays the same kernels on the same weights).

When a call runs eagerly instead (each rule keeps the graph from changing behaviour):

* the caller is capturing a CUDA graph itself, or torch.compile is tracing: the call is part of the
  caller's graph;
* autograd would record the call (grad enabled and the input or a parameter requires grad);
* the shape has been seen fewer than ``GraphPolicy.warmup_calls`` times (its first eager call compiles
  the kernels, packs the weights and runs the numerical guard's probe), or it has more than
  ``GraphPolicy.max_tokens`` rows (prefill: GPU time dominates and each length would hold a graph);
* the module says so (``FP4MoE(check_finite=True)`` reads a flag back on the host every call);
* a capture failed once for that shape (with a warning naming the error).

A graph is dropped, and captured again on a later call, when any tensor of the module (parameter or
buffer, its submodules' included) is replaced or written in place (``load_state_dict``, ``.to()``,
``.half()``), or a submodule replaced: each call compares the identities and write counts
(``Tensor._version``) it saw at capture (``TensorWatch``). Inference-mode tensors keep no write count, so a weight written in place under
``torch.inference_mode`` is not seen: call :meth:`CallGraphs.clear` after such a write.

Graphs of one device and stream share one memory pool: replays on a stream run one after another, so
the intermediates of one graph may reuse another's; a graph's output is copied out before the call
returns. Calls of fp4moe modules on several streams at once each use their stream's pool.

Tuning: :class:`GraphPolicy` (defaults below), changed only through :func:`graph_policy` (a context
manager) or :func:`set_graph_policy`.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from .tuning import current_tuning

__all__ = ["CallGraphs", "GraphPolicy", "RerunGraph", "current_graph_policy", "graph_policy", "eager_calls",
           "set_graph_policy"]


@dataclass(frozen=True)
class GraphPolicy:
    """When a module's call replays a CUDA graph of itself (module docstring).

    enabled: graphs at all.
    warmup_calls: eager calls of a shape before it is captured (>= 1: the first call compiles the
        kernels and runs the guard's probe, which must not happen inside a capture).
    max_tokens: calls with more rows (tokens) than this always run eagerly.
    max_graphs: graphs kept per module; the least recently used is dropped beyond.
    devices: device types whose calls are graphed. "cuda" captures CUDA graphs; any other type
        (tests on CPU) uses :class:`RerunGraph`, which runs the call again on the static buffers, as
        a replay does.
    """

    enabled: bool = True
    warmup_calls: int = 1
    max_tokens: int = 512
    max_graphs: int = 16
    devices: frozenset[str] = field(default_factory=lambda: frozenset({"cuda"}))

    def __post_init__(self) -> None:
        for name in ("warmup_calls", "max_graphs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GraphPolicy.{name}: expected a positive int, got {v!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"GraphPolicy.max_tokens: expected an int >= 0, got {self.max_tokens!r}")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"GraphPolicy.enabled: expected a bool, got {self.enabled!r}")
        object.__setattr__(self, "devices", frozenset(self.devices))


_policy = GraphPolicy()
_policy_lock = threading.Lock()


def current_graph_policy() -> GraphPolicy:
    """The policy in force."""
    return _policy


def set_graph_policy(policy: GraphPolicy | None = None, **changes: Any) -> GraphPolicy:
    """Replace the policy (``policy``, or the current one with ``changes``); returns the old one."""
    global _policy
    with _policy_lock:
        old = _policy
        new = policy if policy is not None else old
        if not isinstance(new, GraphPolicy):
            raise TypeError(f"policy: expected a GraphPolicy, got {type(new).__name__}")
        _policy = replace(new, **changes) if changes else new
    return old


@contextlib.contextmanager
def graph_policy(policy: GraphPolicy | None = None, **changes: Any) -> Iterator[GraphPolicy]:
    """``with graph_policy(enabled=False): ...`` runs the block under a changed policy."""
    old = set_graph_policy(policy, **changes)
    try:
        yield current_graph_policy()
    finally:
        set_graph_policy(old)


_local = threading.local()  # depth of graphed calls (and ``eager_calls`` blocks) running in this thread


@contextlib.contextmanager
def eager_calls() -> Iterator[None]:
    """Within the block, modules' calls run eagerly and count no sightings (a runner that captures a
    whole model step warms it up so; a graphed module's own warm-up runs its submodules so)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


# ----------------------------------------------------------------------------------------------
# graphs


class _PoolShare:
    """One memory pool that the live graphs of a (device, stream) share: ``live`` counts them. A pool
    is never captured into again once its last graph is gone, nor after a capture into it failed
    (PyTorch's allocators keep per-pool state that a dead or half-recorded pool leaves stale: the next
    capture into it fails, "beginAllocateToPool: already recording", or trips an assertion of the
    pinned-memory allocator); a new one takes its place."""

    def __init__(self):
        self.handle = torch.cuda.graph_pool_handle()
        self.live = 0


class _CudaGraph:
    """A CUDA graph captured on a side stream into the pool its live neighbours share (no
    ``gc.collect`` or ``empty_cache`` per capture, which ``torch.cuda.graph`` does)."""

    runs_at_capture = False
    _pools: dict[tuple[int, int], _PoolShare] = {}
    _streams: dict[int, torch.cuda.Stream] = {}

    def __init__(self, device: torch.device):
        self.device = device
        self.graph = torch.cuda.CUDAGraph()

    @staticmethod
    def _release(key: tuple[int, int], share: _PoolShare) -> None:
        share.live -= 1
        if share.live == 0 and _CudaGraph._pools.get(key) is share:
            del _CudaGraph._pools[key]

    def capture(self, fn: Callable[[], Any]) -> Any:
        dev = self.device.index if self.device.index is not None else torch.cuda.current_device()
        current = torch.cuda.current_stream(dev)
        key = (dev, current.cuda_stream)
        share = _CudaGraph._pools.get(key)
        if share is None:
            with torch.cuda.device(dev):
                share = _CudaGraph._pools[key] = _PoolShare()
        side = _CudaGraph._streams.get(dev)
        if side is None:
            side = _CudaGraph._streams[dev] = torch.cuda.Stream(dev)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                self.graph.capture_begin(pool=share.handle, capture_error_mode="thread_local")
                try:
                    out = fn()
                finally:
                    self.graph.capture_end()
        except BaseException:
            if _CudaGraph._pools.get(key) is share:  # never capture into it again
                del _CudaGraph._pools[key]
            raise
        share.live += 1
        weakref.finalize(self, _CudaGraph._release, key, share)
        current.wait_stream(side)
        return out

    def replay(self) -> None:
        self.graph.replay()


class RerunGraph:
    """What a graph replay does, without CUDA: ``capture(fn)`` keeps ``fn`` and its output, and
    ``replay()`` runs ``fn`` again, writing its results into the captured output tensors (the
    kernels of a CUDA graph write the same addresses on every replay). Unlike a CUDA graph it runs
    ``fn`` at capture too (``runs_at_capture``). For CPU tests of the static-buffer logic."""

    runs_at_capture = True

    def __init__(self, device: torch.device):
        self.fn: Callable[[], Any] | None = None
        self.out: Any = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        assert self.fn is not None
        _copy_into(self.out, self.fn())


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)
    elif hasattr(dst, "__dataclass_fields__"):
        for name in dst.__dataclass_fields__:
            _copy_into(getattr(dst, name), getattr(src, name))


def new_graph(device: torch.device):
    """A graph for ``device``: a CUDA graph on CUDA, :class:`RerunGraph` elsewhere."""
    return _CudaGraph(device) if device.type == "cuda" else RerunGraph(device)


# ----------------------------------------------------------------------------------------------
# per-module cache


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors count no writes
        return None


class TensorWatch:
    """What the graphs of a module's calls read, and whether it changed since: the module tree, the
    identity of every parameter and buffer in it, and their write counts (``unchanged()``: a few
    identity comparisons per module, no walk of the tree). It holds the tensors, so that no identity
    is passed on while a graph may read them."""

    def __init__(self, module: nn.Module):
        self.dicts: list[tuple[dict, tuple]] = []
        self.versions: list[tuple[torch.Tensor, int]] = []
        for m in module.modules():
            for group in (m._parameters, m._buffers, m._modules):
                self.dicts.append((group, tuple(group.values())))
            for group in (m._parameters, m._buffers):
                for t in group.values():
                    if t is not None and (v := _version(t)) is not None:
                        self.versions.append((t, v))

    def unchanged(self) -> bool:
        for group, values in self.dicts:
            if len(group) != len(values) or not all(map(operator.is_, group.values(), values)):
                return False
        for t, v in self.versions:
            if t._version != v:
                return False
        return True


@dataclass
class _Entry:
    graph: Any
    static_x: torch.Tensor
    out: torch.Tensor
    aux: Any


class CallGraphs:
    """The graphs of one module's calls, keyed by input shape (module docstring).

    ``run(module, fn, x, key)`` after ``eligible(module, x, rows)``: ``fn(x) -> (tensor, aux)``;
    returns ``fn``'s result, from a graph replay once the shape has been seen (the tensor copied out
    of the graph; ``aux``, e.g. statistics tensors, as captured: updated in place by each replay).
    ``key`` holds whatever else the call depends on (the module's settings).
    """

    def __init__(self):
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._seen: dict[tuple, int] = {}
        self._failed: set[tuple] = set()
        self._watch: TensorWatch | None = None
        self.captures = 0  # graphs captured (statistics; tests)
        self.replays = 0

    def clear(self) -> None:
        """Drop every graph (weights changed in a way the write counts do not show)."""
        self._entries.clear()
        self._seen.clear()
        self._failed.clear()
        self._watch = None

    def __len__(self) -> int:
        return len(self._entries)

    def __deepcopy__(self, memo) -> CallGraphs:  # a copied module captures its own graphs
        return CallGraphs()

    def __reduce__(self):  # pickled modules keep no graphs
        return (CallGraphs, ())

    def eligible(self, module: nn.Module, x: torch.Tensor, rows: int) -> bool:
        """Whether a call of ``module`` on ``x`` may use a graph now (module docstring)."""
        p = _policy
        if not p.enabled or x.device.type not in p.devices or rows == 0 or rows > p.max_tokens:
            return False
        if getattr(_local, "depth", 0):  # inside another module's graphed call or an eager_calls block
            return False
        if torch.compiler.is_compiling():
            return False
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters())):
            return False
        return True

    def run(self, module: nn.Module, fn: Callable[[torch.Tensor], tuple[torch.Tensor, Any]], x: torch.Tensor,
            key: tuple) -> tuple[torch.Tensor, Any]:
        if self._watch is None or not self._watch.unchanged():
            self.clear()
            self._watch = TensorWatch(module)
        stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
        full = (tuple(x.shape), x.dtype, x.device, stream, torch.is_inference_mode_enabled(), current_tuning(), key)
        entry = self._entries.get(full)
        if entry is not None:
            self._entries.move_to_end(full)
            entry.static_x.copy_(x)
            entry.graph.replay()
            self.replays += 1
            return entry.out.clone(), entry.aux
        if full in self._failed:
            with eager_calls():
                return fn(x)
        seen = self._seen.get(full, 0)
        if seen < _policy.warmup_calls:
            self._seen[full] = seen + 1
            with eager_calls():
                return fn(x)
        with eager_calls():
            return self._capture(module, fn, x, full)

    def _capture(self, module: nn.Module, fn, x: torch.Tensor, full: tuple) -> tuple[torch.Tensor, Any]:
        static_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        static_x.copy_(x)
        result = fn(static_x)  # this call's answer; also the warm-up of exactly what is captured
        graph = new_graph(x.device)
        try:
            out, aux = graph.capture(lambda: fn(static_x))
        except Exception as err:  # noqa: BLE001 - any capture failure: stay eager for this shape, say so
            self._failed.add(full)
            warnings.warn(f"fp4moe: could not capture a CUDA graph of {type(module).__name__} for input "
                          f"{tuple(x.shape)} {x.dtype}; calls of that shape run eagerly ({type(err).__name__}: "
                          f"{err})", RuntimeWarning, stacklevel=4)
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            return result
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"CallGraphs: the graphed call must return (tensor, aux), got {type(out).__name__}")
        self._entries[full] = _Entry(graph, static_x, out, aux)
        self.captures += 1
        while len(self._entries) > _policy.max_graphs:
            self._entries.popitem(last=False)
        return result
