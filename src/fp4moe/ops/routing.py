"""MoE routing: configuration, launcher, torch reference, custom op; opportunistic expert activation.

Layers, from the bottom: ``kernels.routing.routing_kernel`` (the @triton.jit body) ->
``launch_routing`` (grid, one launch per pass) -> ``fp4moe::route`` (torch.library custom op with
a fake implementation) -> ``route`` (the public function). ``route_reference`` defines the numerics.

Numerics (all fp32, on the logits x = fp32(logits)):

* ``softmax`` (Qwen3-MoE, Mixtral): choose the k largest x; with ``renormalize`` the weights are
  ``e_i / sum_chosen e_j`` with ``e = exp_f32(x - max x)`` (the full softmax's normaliser cancels),
  without it ``e_i / sum_all e_j``.
* ``sigmoid_bias`` (DeepSeek-V3, GLM-5): ``s = 1 / (1 + exp_f32(-x))``; choose with ``s + bias``
  (grouped: a group's score is the sum of its two largest biased scores, the ``topk_group`` best
  groups stay eligible, ineligible experts are never chosen); weights
  ``s_i / (sum_chosen s_j + 1e-20) * routed_scaling_factor`` (``renormalize``) or
  ``s_i * routed_scaling_factor``.
* ``gpt_oss``: choose the k largest ``x + bias``; weights = softmax over the chosen k,
  ``e_i / sum_chosen e_j`` with ``e = exp_f32(x + bias - max)``.

Order and ties: the k experts of a token come out in descending selection score, equal scores
by lowest expert id. Sums over the chosen experts run in that slot order, the full softmax sum
in expert-id order, one fp32 addition at a time. ``exp_f32`` (below) is a fixed sequence of IEEE
fp32 operations run identically by the kernel, so kernel and reference agree bit for bit on
the CPU interpreter and on every GPU: ids AND weights, whatever the backend's own exp does.
``exp_f32`` is within 1.2 ulp of the exact exponential (``torch.exp`` within 0.56 ulp); weights
therefore differ from ``torch.softmax``/``torch.sigmoid``-based implementations by a few ulp.
Subnormals: exp_f32 flushes results below 2**-126 to 0 in both; a ratio that lands in the
subnormal range (logits more than ~87 apart) is computed without flushing on both sides
(the kernel is compiled with ``enable_reflect_ftz=False``).

Opportunistic expert activation (OEA, arXiv 2511.02237), option ``k0`` (1 <= k0 <= k):
1. each token chooses its own top-``k0`` (as above; grouped routing restricts to its groups);
   the union over the batch is the *active set*;
2. each token fills slots k0..k-1 with the best (by its own selection score) experts of the
   active set it has not chosen yet, still only from its eligible groups;
3. slots it cannot fill (fewer eligible active experts than k - k0, e.g. a batch of one token)
   get id -1 and weight 0; dispatch drops them;
4. weights are renormalised over the chosen experts exactly as the base routing does.
The union of the chosen experts is the active set, so OEA never touches more unique experts
than exact routing (top-k0 is a prefix of top-k). Stats per call (on the device, no sync):
``active_experts`` (unique experts OEA touches), ``exact_experts`` (unique experts exact top-k
routing would touch) and ``kept_fraction[t] = sum_{chosen} m / sum_{exact top-k} m`` per token,
where m is the routing *mass* before renormalisation: ``e = exp_f32(score - row max)`` for
softmax and gpt_oss (proportional to the full-softmax probability), the UNBIASED sigmoid ``s``
for sigmoid_bias. For softmax/gpt_oss the fraction is <= 1; for sigmoid_bias it can exceed 1
when exact routing picked, by biased score, experts of smaller unbiased score.

Implementation: exact routing is one launch; OEA is two (pass 1 marks the active experts in an
int32 [E] mask, pass 2 re-routes and fills), with no host synchronisation.

NaN/Inf in the logits (or bias; for gpt_oss also a finite logit and bias whose sum overflows):
``route_reference`` raises. The kernel routes such a token as if its logits were 0, gives it NaN
weights (so the layer's output for it is NaN, never quietly wrong) and sets ``nonfinite[t] = 1``;
with OEA it adds nothing to the batch's active set nor to ``exact_experts``, and its
``kept_fraction`` (NaN) is left out of the batch mean, so the other tokens route and count as
without it. ``check_finite=True`` reads that flag (one host sync) and
raises ValueError naming the token; ``check_finite="async"`` raises through a device-side
assertion (``torch._assert_async``), which does not synchronise and survives CUDA-graph capture.
"""

from __future__ import annotations

import math
from ._runtime import arch_kwargs, interpreting, pdl_kwargs
import struct
from dataclasses import dataclass
from typing import Literal, Union

import torch

from ..models import Routing

__all__ = ["RoutingConfig", "RoutingResult", "OEAStats", "route", "route_reference", "launch_routing",
           "make_router", "compile_requests", "exp_f32", "EXP_F32", "MAX_EXPERTS"]

MAX_EXPERTS = 1024  # a token's whole row of logits is one tile row
_KINDS = {"softmax": 0, "sigmoid_bias": 1, "gpt_oss": 2}
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CheckFinite = Union[bool, Literal["async"]]


def _f32(v: float) -> float:
    """The nearest fp32 value, as a Python float (exactly representable in fp32)."""
    return struct.unpack("f", struct.pack("f", v))[0]


@dataclass(frozen=True)
class _ExpConstants:
    lo: float = -104.0  # below: exp < 2**-150, result 0
    hi: float = 89.0  # above: exp > FLT_MAX, result inf
    log2e: float = _f32(1.0 / math.log(2.0))
    ln2_hi: float = 0.693145751953125  # 16 significant bits: n * ln2_hi is exact for |n| < 256
    ln2_lo: float = _f32(math.log(2.0) - 0.693145751953125)
    coefficients: tuple[float, ...] = tuple(_f32(1.0 / math.factorial(i)) for i in range(8))  # c0..c7
    flt_min: float = 2.0 ** -126
    sum_eps: float = _f32(1e-20)


EXP_F32 = _ExpConstants()


def exp_f32(x: torch.Tensor) -> torch.Tensor:
    """exp of finite fp32 ``x`` as a fixed sequence of IEEE fp32 operations (the kernel's).

    x = n ln2 + r with n = floor(x log2e + 0.5) (Cody-Waite, two-part ln2), p(r) = degree-7
    Taylor polynomial in Horner form, result p * 2**(n>>1) * 2**(n - (n>>1)) (two exact scalings,
    so 2**n may leave the normal range), flushed to 0 below 2**-126. Max error 1.2 ulp.
    """
    c = EXP_F32
    xc = x.clamp(c.lo, c.hi)
    n = torch.floor(xc * c.log2e + 0.5)
    r = xc - n * c.ln2_hi
    r = r - n * c.ln2_lo
    p = r * c.coefficients[7] + c.coefficients[6]
    for coef in c.coefficients[5::-1]:
        p = p * r + coef
    ni = n.to(torch.int32)
    n1 = ni >> 1
    n2 = ni - n1
    y = p * ((n1 + 127) << 23).view(torch.float32)
    y = y * ((n2 + 127) << 23).view(torch.float32)
    return torch.where(y < c.flt_min, torch.zeros_like(y), y)


def _sigmoid_f32(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp_f32(-x)), one IEEE division (not torch.sigmoid, whose CPU and GPU code differ)."""
    d = 1.0 + exp_f32(-x)
    return torch.ones_like(d) / d


# ----------------------------------------------------------------------------------------------
# configuration


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class RoutingConfig:
    """``block_t`` tokens per program (a power of two), run by ``num_warps`` warps."""

    block_t: int
    num_warps: int

    def __post_init__(self) -> None:
        if self.block_t < 1 or self.block_t & (self.block_t - 1) or self.block_t > 256:
            raise ValueError(f"RoutingConfig.block_t: expected a power of two in 1..256, got {self.block_t}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"RoutingConfig.num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")

    def __str__(self) -> str:
        return f"t{self.block_t}_w{self.num_warps}"

    @staticmethod
    def from_heuristic(T: int, E: int, top_k: int) -> RoutingConfig:
        """One token per program, one warp per 256 experts (at most 4). A token's top-k is a chain
        of dependent reductions, so what bounds the kernel is the serial work per thread (the
        logits each thread holds) and cross-warp reductions, not parallelism
        (docs/performance-engineering.md, ``RoutingConfig.from_heuristic``)."""
        return RoutingConfig(block_t=1, num_warps=max(1, min(4, _next_pow2(E) // 256)))

    @staticmethod
    def candidates(T: int, E: int, top_k: int) -> list[RoutingConfig]:
        return [RoutingConfig(bt, w) for bt in (1, 2, 4, 8, 16) if bt * _next_pow2(E) <= 8192 for w in (1, 2, 4)]


# ----------------------------------------------------------------------------------------------
# results


@dataclass
class OEAStats:
    """Per-call statistics of opportunistic expert activation (device tensors; reading them syncs)."""

    # int32 []: unique experts the OEA routing touches (= the active set; a NaN/Inf token's own slots,
    # experts 0..k0-1 by the tie rule, are left out: they serve no finite token)
    active_experts: torch.Tensor
    exact_experts: torch.Tensor  # int32 []: unique experts exact top-k routing would touch
    kept_fraction: torch.Tensor  # fp32 [T]: chosen mass / exact top-k mass, per token (module docstring)

    def mean_kept_fraction(self) -> torch.Tensor:
        """The batch's mean of ``kept_fraction`` over its finite tokens (fp32 [], NaN for an empty
        batch or one of NaN/Inf tokens only)."""
        return self.kept_fraction.nanmean()

    def summary(self) -> dict[str, float]:
        """The numbers a report wants, read from the device (one host sync): active_experts,
        exact_experts, kept_weight (the mean kept fraction)."""
        return {"active_experts": int(self.active_experts), "exact_experts": int(self.exact_experts),
                "kept_weight": float(self.mean_kept_fraction())}

    def get(self, key: str, default=None):
        """Mapping-style access to ``summary()`` (host sync; never inside graph capture)."""
        return self.summary().get(key, default)


@dataclass
class RoutingResult:
    topk_ids: torch.Tensor  # int32 [T, k], descending score, ties by id; -1: slot OEA left empty
    topk_weights: torch.Tensor  # fp32 [T, k], 0 for empty slots
    nonfinite: torch.Tensor  # int32 [T]: 1 where the token's logits (or the bias) held NaN/Inf
    stats: OEAStats | None = None  # with k0 only


# ----------------------------------------------------------------------------------------------
# validation


def _check(logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None, k0: int | None,
           *, kernel: bool) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits: expected a torch.Tensor, got {type(logits).__name__}")
    if not isinstance(routing, Routing):
        raise TypeError(f"routing: expected fp4moe.models.Routing, got {type(routing).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits: expected a 2-D tensor [T, E], got shape {tuple(logits.shape)}")
    if logits.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"logits: expected float32, bfloat16 or float16, got {logits.dtype}")
    T, E = logits.shape
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"logits: expected 1..{MAX_EXPERTS} experts (columns), got {E}")
    if routing.kind not in _KINDS:
        raise ValueError(f"routing.kind: expected one of {sorted(_KINDS)}, got {routing.kind!r}")
    k = routing.top_k
    if not 1 <= k <= E:
        raise ValueError(f"routing.top_k: expected 1..E={E}, got {k}")
    if routing.kind == "sigmoid_bias":
        ng, tg = routing.n_group, routing.topk_group
        if ng < 1 or E % ng:
            raise ValueError(f"routing.n_group: expected a divisor of E={E}, got {ng}")
        if not 1 <= tg <= ng:
            raise ValueError(f"routing.topk_group: expected 1..n_group={ng}, got {tg}")
        if k > tg * (E // ng):
            raise ValueError(f"routing.top_k: expected <= topk_group * E / n_group = {tg * (E // ng)} "
                             f"(the experts of the kept groups), got {k}")
    else:
        if routing.n_group != 1 or routing.topk_group != 1:
            name, v = ("n_group", routing.n_group) if routing.n_group != 1 else ("topk_group", routing.topk_group)
            raise ValueError(f"routing.{name}: grouped top-k is implemented for 'sigmoid_bias' only; "
                             f"expected 1 for {routing.kind!r}, got {v}")
        if routing.routed_scaling_factor != 1.0:
            raise ValueError(f"routing.routed_scaling_factor: expected 1.0 for {routing.kind!r} "
                             f"(applied by 'sigmoid_bias' only), got {routing.routed_scaling_factor}")
    if bias is not None:
        if routing.kind == "softmax":
            raise ValueError("bias: 'softmax' routing takes no bias (only 'sigmoid_bias' and 'gpt_oss' do)")
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise TypeError(f"bias: expected a floating-point torch.Tensor, got {getattr(bias, 'dtype', type(bias))}")
        if tuple(bias.shape) != (E,):
            raise ValueError(f"bias: expected shape ({E},) (one per expert), got {tuple(bias.shape)}")
        if bias.device != logits.device:
            raise ValueError(f"bias: expected device {logits.device} (that of logits), got {bias.device}")
    if k0 is not None:
        if isinstance(k0, bool) or not isinstance(k0, int) or not 1 <= k0 <= k:
            raise ValueError(f"k0: expected an int in 1..top_k={k}, got {k0!r}")
    if kernel and logits.device.type == "cpu" and not interpreting():
        raise ValueError("logits: CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter); "
                         "move them to a CUDA device")


# ----------------------------------------------------------------------------------------------
# reference


def _topk_reference(sel: torch.Tensor, eligible: torch.Tensor, n: int) -> torch.Tensor:
    """The n eligible experts of largest ``sel`` per row, descending, equal scores by lowest id;
    -1 where fewer than n are eligible. ``sel`` is finite."""
    # + 0.0 turns -0.0 into +0.0: equal scores must tie, and a radix sort (CUDA) would order them
    key = torch.where(eligible, sel, torch.full_like(sel, -math.inf)) + 0.0
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :n]
    return torch.where(eligible.gather(1, order), order, torch.full_like(order, -1)).to(torch.int32)


def _group_eligible_reference(sel: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    T, E = sel.shape
    if n_group == 1:
        return torch.ones_like(sel, dtype=torch.bool)
    grouped = torch.sort(sel.view(T, n_group, E // n_group), dim=2, descending=True).values
    score = grouped[:, :, 0] + grouped[:, :, 1] if E // n_group >= 2 else grouped[:, :, 0]
    keep = torch.sort(score + 0.0, dim=1, descending=True, stable=True).indices[:, :topk_group]
    group_ok = torch.zeros(T, n_group, dtype=torch.bool, device=sel.device).scatter_(1, keep, True)
    return group_ok.repeat_interleave(E // n_group, dim=1)


def _sum_in_order(v: torch.Tensor) -> torch.Tensor:
    """Row sums adding the columns one at a time, left to right (the kernel's order)."""
    total = torch.zeros(v.shape[0], dtype=torch.float32, device=v.device)
    for j in range(v.shape[1]):
        total = total + v[:, j]
    return total


def _scores_reference(x: torch.Tensor, routing: Routing, bias: torch.Tensor | None):
    """(sel, val, e_full): selection score, routing mass (see the module docstring), and for
    softmax the un-normalised exponentials of every expert."""
    b = bias.to(torch.float32) if bias is not None else None
    if routing.kind == "softmax":
        e = exp_f32(x - x.max(dim=1, keepdim=True).values)
        return x, e, e
    if routing.kind == "sigmoid_bias":
        s = _sigmoid_f32(x)
        return (s + b if b is not None else s), s, None
    sel = x + b if b is not None else x
    return sel, exp_f32(sel - sel.max(dim=1, keepdim=True).values), None


def route_reference(logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None = None,
                    k0: int | None = None) -> RoutingResult:
    """The routing every kernel must reproduce bit for bit (module docstring: numerics and OEA)."""
    _check(logits, routing, bias, k0, kernel=False)
    x = logits.to(torch.float32)
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        t, e = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"logits: NaN/Inf in router logits (first at token {t}, expert {e}: {x[t, e].item()})")
    if bias is not None and not bool(torch.isfinite(bias).all()):
        raise ValueError("bias: NaN/Inf in the routing bias")
    if routing.kind == "gpt_oss" and bias is not None:
        over = ~torch.isfinite(x + bias.to(torch.float32))
        if bool(over.any()):
            t, e = (int(v) for v in over.nonzero()[0])
            raise ValueError(f"logits + bias: the selection score overflows fp32 (first at token {t}, expert {e})")
    T, E = x.shape
    k = routing.top_k
    sel, val, e_full = _scores_reference(x, routing, bias)
    eligible = _group_eligible_reference(sel, routing.n_group, routing.topk_group) \
        if routing.kind == "sigmoid_bias" else torch.ones_like(x, dtype=torch.bool)

    if k0 is None:
        ids = _topk_reference(sel, eligible, k)
    else:
        own = _topk_reference(sel, eligible, k0)
        active = torch.zeros(E, dtype=torch.bool, device=x.device)
        active[own.flatten().long()] = True
        candidates = eligible & active[None, :]
        candidates.scatter_(1, own.long(), False)
        ids = torch.cat([own, _topk_reference(sel, candidates, k - k0)], dim=1)
    valid = ids >= 0
    mass = torch.where(valid, val.gather(1, ids.clamp(min=0).long()), torch.zeros((), device=x.device))
    chosen = _sum_in_order(mass)

    if routing.kind == "softmax":
        denom = chosen if routing.renormalize else _sum_in_order(e_full)
        weights = mass / denom[:, None]
    elif routing.kind == "sigmoid_bias":
        if routing.renormalize:
            weights = mass / (chosen + EXP_F32.sum_eps)[:, None] * routing.routed_scaling_factor
        else:
            weights = mass * routing.routed_scaling_factor
    else:
        weights = mass / chosen[:, None]

    stats = None
    if k0 is not None:
        exact = _topk_reference(sel, eligible, k)
        exact_mass = _sum_in_order(val.gather(1, exact.long()))
        stats = OEAStats(
            active_experts=torch.tensor(torch.unique(ids[valid]).numel(), dtype=torch.int32, device=x.device),
            exact_experts=torch.tensor(torch.unique(exact).numel(), dtype=torch.int32, device=x.device),
            kept_fraction=chosen / exact_mass,
        )
    return RoutingResult(topk_ids=ids, topk_weights=weights, stats=stats,
                         nonfinite=torch.zeros(T, dtype=torch.int32, device=x.device))


# ----------------------------------------------------------------------------------------------
# launcher


def launch_routing(logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None, k0: int | None,
                   config: RoutingConfig):
    """Launch the routing kernel (one pass, or OEA's two). ``logits`` [T, E] with unit column
    stride, T >= 1. Returns (ids, weights, nonfinite, active [E] or None, exact [E] or None,
    kept_fraction [T] or None)."""
    import triton

    from ..kernels.routing import PASS_EXACT, PASS_OEA_FILL, PASS_OEA_MARK, routing_kernel

    T, E = logits.shape
    k = routing.top_k
    dev = logits.device
    ids = torch.empty((T, k), dtype=torch.int32, device=dev)
    weights = torch.empty((T, k), dtype=torch.float32, device=dev)
    bad = torch.empty((T,), dtype=torch.int32, device=dev)
    grid = (triton.cdiv(T, config.block_t),)
    grouped = routing.kind == "sigmoid_bias" and routing.n_group > 1
    n_group = routing.n_group if grouped else 1
    common = dict(
        KIND=_KINDS[routing.kind], TOP_K=k, RENORM=bool(routing.renormalize), N_GROUP=n_group,
        TOPK_GROUP=routing.topk_group if grouped else 1, HAS_BIAS=bias is not None,
        BLOCK_T=config.block_t, BLOCK_E=_next_pow2(E), BLOCK_K=_next_pow2(k), BLOCK_G=_next_pow2(n_group),
        num_warps=config.num_warps, enable_fp_fusion=False, enable_reflect_ftz=False, **pdl_kwargs(dev),
    )
    bias_arg = bias.to(torch.float32).contiguous() if bias is not None else logits
    scale = float(routing.routed_scaling_factor)
    gsize = E // n_group
    if k0 is None:
        routing_kernel[grid](logits, bias_arg, ids, weights, bad, bad, bad, weights, T, E, logits.stride(0), gsize,
                             scale, PASS=PASS_EXACT, K0=k, **common, **arch_kwargs(dev))
        return ids, weights, bad, None, None, None
    active = torch.zeros((E,), dtype=torch.int32, device=dev)
    exact = torch.zeros((E,), dtype=torch.int32, device=dev)
    kept = torch.empty((T,), dtype=torch.float32, device=dev)
    routing_kernel[grid](logits, bias_arg, ids, weights, bad, active, exact, kept, T, E, logits.stride(0), gsize,
                         scale, PASS=PASS_OEA_MARK, K0=k0, **common, **arch_kwargs(dev))
    routing_kernel[grid](logits, bias_arg, ids, weights, bad, active, exact, kept, T, E, logits.stride(0), gsize,
                         scale, PASS=PASS_OEA_FILL, K0=k0, **common, **arch_kwargs(dev))
    return ids, weights, bad, active, exact, kept


# ----------------------------------------------------------------------------------------------
# torch.library custom op


@torch.library.custom_op("fp4moe::route", mutates_args=())
def _route_op(logits: torch.Tensor, bias: torch.Tensor | None, kind: str, top_k: int, renormalize: bool,
              n_group: int, topk_group: int, routed_scaling_factor: float, k0: int, block_t: int,
              num_warps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                       torch.Tensor]:
    """k0 = 0: exact routing (the three stats outputs are empty); block_t = 0: heuristic config."""
    return _route_impl(logits, bias, kind, top_k, renormalize, n_group, topk_group, routed_scaling_factor, k0,
                       block_t, num_warps)


def _route_impl(logits, bias, kind, top_k, renormalize, n_group, topk_group, routed_scaling_factor, k0, block_t,
                num_warps):
    """The body of ``fp4moe::route`` (``route`` calls it directly where nothing traces the call)."""
    routing = Routing(kind, top_k=top_k, renormalize=renormalize, n_group=n_group, topk_group=topk_group,
                      routed_scaling_factor=routed_scaling_factor)  # type: ignore[arg-type]
    T, E = logits.shape
    if T == 0:
        ids, w, bad = _empty_outputs(logits, top_k)
        act, exa, kept = _empty_stats(logits, k0)
        return ids, w, bad, act, exa, kept
    cfg = RoutingConfig(block_t, num_warps) if block_t else RoutingConfig.from_heuristic(T, E, top_k)
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    ids, w, bad, active, exact, kept = launch_routing(x, routing, bias, k0 or None, cfg)
    if not k0:
        act, exa, kept = _empty_stats(logits, 0)
        return ids, w, bad, act, exa, kept
    return ids, w, bad, active.sum(dtype=torch.int32), exact.sum(dtype=torch.int32), kept


def _empty_outputs(logits: torch.Tensor, k: int):
    T = logits.shape[0]
    dev = logits.device
    return (torch.empty((T, k), dtype=torch.int32, device=dev), torch.empty((T, k), dtype=torch.float32, device=dev),
            torch.empty((T,), dtype=torch.int32, device=dev))


def _empty_stats(logits: torch.Tensor, k0: int):
    """OEA's statistics of no tokens (no experts; k0 > 0), or, for exact routing (k0 = 0), the custom
    op's stats outputs, which ``route`` drops (it returns ``stats=None``): left uninitialised, so that
    exact routing launches nothing after its kernel (docs/performance-engineering.md,
    ``_empty_stats``)."""
    dev = logits.device
    make = torch.zeros if k0 else torch.empty
    n = logits.shape[0] if k0 else 0
    return (make((), dtype=torch.int32, device=dev), make((), dtype=torch.int32, device=dev),
            torch.empty((n,), dtype=torch.float32, device=dev))


@_route_op.register_fake
def _route_fake(logits, bias, kind, top_k, renormalize, n_group, topk_group, routed_scaling_factor, k0, block_t,
                num_warps):
    ids, w, bad = _empty_outputs(logits, top_k)
    act, exa, kept = _empty_stats(logits, k0)
    return ids, w, bad, act, exa, kept


# ----------------------------------------------------------------------------------------------
# public function


def route(logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None = None, *, k0: int | None = None,
          config: RoutingConfig | None = None, check_finite: CheckFinite = False) -> RoutingResult:
    """Route tokens to experts: top-k ids and weights (module docstring: numerics, OEA, stats).

    Args:
        logits: router logits [T, E], fp32/bf16/fp16 (E <= 1024, any value; T may be 0).
        routing: the model's routing (``fp4moe.models.Routing``).
        bias: [E] correction bias (``sigmoid_bias``: e_score_correction_bias, used for the choice
            only) or logit bias (``gpt_oss``, when the router's own bias is not already in the logits).
        k0: opportunistic expert activation: keep each token's top-k0, fill the rest from the
            experts the batch already activated. None: exact top-k.
        config: pin a kernel configuration (tests, tuning); None chooses one.
        check_finite: False: no check (NaN/Inf rows get NaN weights and ``nonfinite`` = 1);
            True: raise ValueError on NaN/Inf (one host sync; call it outside graph capture, e.g.
            on a layer's first call); "async": a device-side assertion, no sync.

    No host synchronisation unless ``check_finite=True``; CUDA-graph capturable at fixed T.
    """
    _check(logits, routing, bias, k0, kernel=True)
    check_finite_option(check_finite)
    from ._direct import runs_direct

    op = _route_impl if runs_direct(logits, bias) else _route_op
    ids, w, bad, act, exa, kept = op(
        logits, bias, routing.kind, routing.top_k, routing.renormalize, routing.n_group, routing.topk_group,
        float(routing.routed_scaling_factor), k0 or 0, config.block_t if config else 0,
        config.num_warps if config else 0)
    if check_finite is True and logits.shape[0] and bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise ValueError(f"logits: NaN/Inf in router logits at token {t} (or in the bias); "
                         f"{int(bad.sum())} of {logits.shape[0]} tokens affected")
    if check_finite == "async" and logits.shape[0]:
        torch._assert_async(bad.max() == 0, "fp4moe.route: NaN/Inf in router logits (or in the bias)")
    stats = OEAStats(active_experts=act, exact_experts=exa, kept_fraction=kept) if k0 is not None else None
    return RoutingResult(topk_ids=ids, topk_weights=w, nonfinite=bad, stats=stats)


def check_finite_option(check_finite) -> None:
    """``route``'s ``check_finite``: False, True or "async"."""
    if check_finite not in (False, True, "async"):
        raise ValueError(f"check_finite: expected False, True or 'async', got {check_finite!r}")


def make_router(model, bias: torch.Tensor | None = None, config: RoutingConfig | None = None):
    """``(logits, k0=None) -> (topk_ids, topk_weights, stats)`` for a model (``fp4moe.models.MoEModel``):
    the benchmark's hook. ``stats`` is None for exact routing, else ``OEAStats`` (``stats.get
    ("kept_weight")`` reads the mean kept fraction). No host sync inside the call."""
    routing = model.routing

    def run(logits: torch.Tensor, k0: int | None = None):
        r = route(logits, routing, bias, k0=k0, config=config)
        return r.topk_ids, r.topk_weights, r.stats

    return run


# ----------------------------------------------------------------------------------------------
# planner


def compile_requests(routing: Routing, E: int, config: RoutingConfig, cc: int, *, k0: int | None = None,
                     logits_dtype: str = "bf16") -> list:
    """Cross-compilation requests (``fp4moe.plan.crosscompile``) for the launches ``route`` makes:
    one pass, or OEA's two. (The planner compiles with default options; the launcher adds
    ``enable_fp_fusion=False``, which changes instruction selection, not resources much.)"""
    from ..target import get_arch
    from ..target.compile_request import CompileRequest

    grouped = routing.kind == "sigmoid_bias" and routing.n_group > 1
    n_group = routing.n_group if grouped else 1
    signature = {
        "logits_ptr": f"*{logits_dtype}", "bias_ptr": "*fp32", "ids_ptr": "*i32", "weights_ptr": "*fp32",
        "bad_ptr": "*i32", "active_ptr": "*i32", "exact_ptr": "*i32", "kept_ptr": "*fp32",
        "T": "i32", "E": "i32", "stride_t": "i32", "gsize": "i32", "scale": "fp32",
    }
    common = {
        "KIND": _KINDS[routing.kind], "TOP_K": routing.top_k, "RENORM": bool(routing.renormalize),
        "N_GROUP": n_group, "TOPK_GROUP": routing.topk_group if grouped else 1,
        "HAS_BIAS": routing.kind != "softmax", "BLOCK_T": config.block_t, "BLOCK_E": _next_pow2(E),
        "BLOCK_K": _next_pow2(routing.top_k), "BLOCK_G": _next_pow2(n_group), "PDL": int(get_arch(cc).has_pdl),
    }
    passes = [(0, routing.top_k)] if k0 is None else [(1, k0), (2, k0)]
    return [CompileRequest(kernel="fp4moe.kernels.routing:routing_kernel", signature=signature,
                           constexprs={**common, "PASS": p, "K0": k}, cc=cc, num_warps=config.num_warps,
                           num_stages=1) for p, k in passes]
