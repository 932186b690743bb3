"""An FP4 MoE block split over ranks: experts partitioned (expert parallelism), each expert's
intermediate size split (tensor parallelism), or both.

Per call, on every rank::

    route own tokens (the router is replicated: routing is computed once per token, by its rank)
    -> dispatch the (token, expert) pairs to the ranks that own the experts
    -> the local experts on the same grouped kernels (``fp4moe.ops.moe.moe_experts``)
    -> combine each token's outputs back on its rank
    -> one all-reduce over the tensor-parallel group (the shared expert's partial output included)

``dispatch`` says where the tokens are and how pairs travel:

* ``"all_gather"``: each expert-parallel rank holds its own tokens (any count, zero included); all
  of the group's tokens are gathered on every rank (counts first, padded to the largest), each rank
  runs its experts on all of them, and a reduce-scatter returns each rank the sum for its own tokens.
  Fixed message sizes; what engines measure as the faster choice up to about 8 ranks, and on PCIe.
* ``"all_to_all"``: own tokens as above; each token is sent once to every rank that owns one of its
  experts (counts first, then ``all_to_all_single``), and the outputs come back the same way.
* ``"replicated"``: every rank of the expert-parallel group holds the same tokens (tensor-parallel
  attention before the block); each runs its own experts on them, and one all-reduce over the whole
  group sums the outputs: no dispatch at all.

Numerics: each rank's partial output is rounded to x's dtype before it is summed (in
``reduce_dtype``, default x's), so results match the single-process block within the reduction
order's rounding, not bit for bit. Biases of the down projection are added by one rank of each
tensor-parallel group only. The block never captures CUDA graphs of its own calls (collectives do
not replay inside a per-module graph); a decode step captured as a whole, NCCL included, does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from ..models import Routing
from ..nn import FP4Linear, FP4MoE, GatedMLP, check_block_input, register_experts
from ..quantize import FP4Tensor
from .groups import ParallelGroups
from .linear import all_reduce, column_parallel, row_parallel
from .shard import ExpertPlacement, shard_gate_up, shard_k, take_experts

__all__ = ["BlockParts", "DISPATCH_MODES", "ParallelFP4MoE", "shard_moe_blocks"]

Dispatch = Literal["all_gather", "all_to_all", "replicated"]
DISPATCH_MODES: tuple[str, ...] = ("all_gather", "all_to_all", "replicated")


def _check_local(parts: BlockParts, w13: FP4Tensor, w2: FP4Tensor, E: int, H: int) -> None:
    """What FP4MoE checks of a whole block, on this rank's experts and the whole router."""
    from ..ops._runtime import check_weight_scales
    from ..ops.moe import check_mode_and_activation, check_moe_inputs
    from ..ops.routing import _check as check_routing

    check_routing(torch.empty(0, E, dtype=torch.float32, device=parts.router_weight.device), parts.routing,
                  parts.selection_bias, parts.k0, kernel=False)
    k = min(parts.routing.top_k, w13.shape[0])
    check_moe_inputs(torch.zeros(1, H, dtype=torch.bfloat16, device=w13.device), w13, w2,
                     torch.zeros(1, k, dtype=torch.int32, device=w13.device), torch.zeros(1, k, device=w13.device))
    check_mode_and_activation(parts.mode, parts.activation, w13)
    check_weight_scales(w13, "w13")
    check_weight_scales(w2, "w2")


def _shard_shared(moe: BlockParts, groups: ParallelGroups, reduce_dtype):
    """The shared expert's tensor-parallel shard: (gate_up, down, module, sharded). A module other
    than FP4Linear pairs or a GatedMLP of FP4Linears is kept whole on every rank (sharded False)."""
    tp, i = groups.tp, groups.tp_rank
    if moe.shared_gate_up is not None:
        if tp == 1:
            return moe.shared_gate_up, moe.shared_down, None, True
        gu = moe.shared_gate_up
        w = shard_gate_up(gu.weight_fp4, tp, i)
        bias = None if gu.bias is None else shard_gate_up(gu.bias.detach(), tp, i)
        gate_up = FP4Linear.from_fp4(w, bias, mode=gu.mode, input_scale=gu.input_scale)
        down = moe.shared_down
        local_down = FP4Linear.from_fp4(shard_k(down.weight_fp4, tp, i),
                                        None if down.bias is None or i else down.bias.detach(),
                                        mode=down.mode, input_scale=down.input_scale)
        return gate_up, local_down, None, True
    m = moe.shared_expert
    if m is None:
        return None, None, None, True
    if tp > 1 and isinstance(m, GatedMLP) and all(isinstance(p, FP4Linear) for p in (m.gate_proj, m.up_proj,
                                                                                        m.down_proj)):
        down = row_parallel(m.down_proj, tp, i, None, reduce_dtype=reduce_dtype)  # reduced with the experts
        local_down = down.local
        if m.down_proj.bias is not None and i == 0:
            local_down = FP4Linear.from_fp4(local_down.weight_fp4, m.down_proj.bias.detach(), mode=local_down.mode,
                                            input_scale=local_down.input_scale)
        return None, None, GatedMLP(column_parallel(m.gate_proj, tp, i), column_parallel(m.up_proj, tp, i),
                                    local_down), True
    return None, None, m, tp == 1


@dataclass(frozen=True)
class BlockParts:
    """What an MoE block is made of, with its routed experts whole or already cut to one
    expert-parallel rank's (``expert_ids``: their global ids, in order; None: all experts).

    :meth:`of_module` reads them from an :class:`fp4moe.nn.FP4MoE`; a sharded loader builds them
    from the experts a rank reads (``fp4moe.integrations.transformers.load_fp4_model(parallel=...)``).
    """

    router_weight: torch.Tensor  # [E, H], every expert's row
    w13: FP4Tensor  # [E or len(expert_ids), 2I, H]
    w2: FP4Tensor  # [E or len(expert_ids), H, I]
    routing: Routing
    expert_ids: tuple[int, ...] | None = None
    router_bias: torch.Tensor | None = None
    selection_bias: torch.Tensor | None = None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    shared_gate_up: FP4Linear | None = None
    shared_down: FP4Linear | None = None
    shared_expert: nn.Module | None = None
    activation: str = "silu"
    interleaved: bool = False
    mode: str = "w4a16"
    router_dtype: torch.dtype | None = None
    k0: int | None = None
    check_finite: bool | str = False
    returns_tuple: bool = False

    @classmethod
    def of_module(cls, moe: FP4MoE) -> BlockParts:
        if not isinstance(moe, FP4MoE):
            raise TypeError(f"moe: expected an fp4moe.nn.FP4MoE, got {type(moe).__name__}")
        return cls(router_weight=moe.router_weight, w13=moe.w13, w2=moe.w2, routing=moe.routing,
                   router_bias=moe.router_bias, selection_bias=moe.selection_bias, w13_bias=moe.w13_bias,
                   w2_bias=moe.w2_bias, shared_gate_up=moe.shared_gate_up, shared_down=moe.shared_down,
                   shared_expert=moe.shared_expert, activation=moe.activation, interleaved=moe.interleaved,
                   mode=moe.mode, router_dtype=moe.router_dtype, k0=moe.k0, check_finite=moe.check_finite,
                   returns_tuple=bool(getattr(moe, "returns_tuple", False)))


class ParallelFP4MoE(nn.Module):
    """One rank's part of an MoE block (module docstring): made on each rank from the same
    :class:`fp4moe.nn.FP4MoE` (:meth:`from_module`) or from :class:`BlockParts` holding the rank's
    experts; called like the block on this rank's x [..., H].

    Buffers keep FP4MoE's names (the local experts' ``w13_weight``, ...) plus ``expert_ids``, the
    global ids of the local experts; ``last_stats`` is the routing statistics of this rank's tokens.
    """

    def __init__(self, parts: BlockParts | FP4MoE, groups: ParallelGroups, *,
                 placement: ExpertPlacement | Sequence[Sequence[int]] | None = None, dispatch: Dispatch = "all_gather",
                 reduce_dtype: torch.dtype | None = None):
        super().__init__()
        if isinstance(parts, FP4MoE):
            parts = BlockParts.of_module(parts)
        if not isinstance(parts, BlockParts):
            raise TypeError(f"parts: expected an fp4moe.nn.FP4MoE or BlockParts, got {type(parts).__name__}")
        if not isinstance(groups, ParallelGroups):
            raise TypeError(f"groups: expected a ParallelGroups (fp4moe.distributed.make_groups), got "
                            f"{type(groups).__name__}")
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch: expected one of {', '.join(DISPATCH_MODES)}, got {dispatch!r}")
        if reduce_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"reduce_dtype: expected None (x's dtype), float32, bfloat16 or float16, got {reduce_dtype}")
        E, H = parts.router_weight.shape
        self.placement = ExpertPlacement.of(placement, E, groups.ep)
        self.groups, self.dispatch, self.reduce_dtype = groups, dispatch, reduce_dtype
        self.n_experts, self.hidden = E, H
        owned = self.placement.owners[groups.ep_rank]
        mine = torch.tensor(owned, dtype=torch.long)
        if parts.expert_ids is None:  # whole: take this rank's experts
            if parts.w13.shape[0] != E:
                raise ValueError(f"w13: expected the router's {E} experts, got {tuple(parts.w13.shape)}")
            w13, w2 = take_experts(parts.w13, mine), take_experts(parts.w2, mine)
            w13_bias, w2_bias = take_experts(parts.w13_bias, mine), take_experts(parts.w2_bias, mine)
        elif tuple(parts.expert_ids) == owned:
            w13, w2, w13_bias, w2_bias = parts.w13, parts.w2, parts.w13_bias, parts.w2_bias
        else:
            raise ValueError(f"parts.expert_ids: expected rank {groups.ep_rank}'s experts {list(owned)[:8]}"
                             f"{'...' if len(owned) > 8 else ''} of the placement, got {list(parts.expert_ids)[:8]}")
        _check_local(parts, w13, w2, E, H)
        tp, i = groups.tp, groups.tp_rank
        w13 = shard_gate_up(w13, tp, i, interleaved=parts.interleaved, block=w13.fmt.block_size)  # w2's K: whole blocks
        w2 = shard_k(w2, tp, i)
        if w13_bias is not None:
            w13_bias = shard_gate_up(w13_bias, tp, i, interleaved=parts.interleaved)
        w2_bias = w2_bias if i == 0 else None  # added once per tensor-parallel group
        # the router and its settings as the whole block has them: FP4MoE.route reads these names
        self.routing, self.k0, self.check_finite = parts.routing, parts.k0, parts.check_finite
        self.router_dtype, self.mode, self.activation = parts.router_dtype, parts.mode, parts.activation
        self.interleaved, self.returns_tuple = parts.interleaved, parts.returns_tuple
        device = parts.router_weight.device
        self.register_buffer("router_weight", parts.router_weight.detach())
        self.register_buffer("router_bias", parts.router_bias)
        self.register_buffer("selection_bias", None if parts.selection_bias is None else parts.selection_bias.float())
        register_experts(self, w13, w2)
        self.register_buffer("w13_bias", w13_bias)
        self.register_buffer("w2_bias", w2_bias)
        self.register_buffer("expert_ids", mine.to(device))
        self.register_buffer("local_of", self.placement.local_table().to(device), persistent=False)
        self.register_buffer("owner_of", self.placement.owner_table().to(device), persistent=False)
        self.shared_gate_up, self.shared_down, self.shared_expert, self._shared_sharded = \
            _shard_shared(parts, groups, reduce_dtype)
        self.last_stats = None

    @classmethod
    def from_module(cls, moe: FP4MoE, groups: ParallelGroups, **kwargs) -> ParallelFP4MoE:
        """This rank's part of ``moe`` (the same block on every rank; keyword arguments as the class)."""
        return cls(BlockParts.of_module(moe), groups, **kwargs)

    # FP4MoE's own methods, on the same attribute names: the experts' FP4 views, ``.to()`` that keeps
    # their dtypes and packs them on a GPU, the whole block's routing of this rank's tokens, the shared expert
    _stacked, w13, w2, _apply = FP4MoE._stacked, FP4MoE.w13, FP4MoE.w2, FP4MoE._apply
    route, shared = FP4MoE.route, FP4MoE.shared

    def _local(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               shared_out: torch.Tensor | None = None) -> torch.Tensor:
        """The local experts on x [T, H] for the pairs whose local ids are >= 0 (the rest dropped),
        plus ``shared_out``."""
        from ..ops.moe import moe_experts

        n_local = self._fp4["w13"][0][0]
        if ids.shape[1] > n_local:  # top-k above the local expert count: a token has at most n_local local pairs
            order = (ids < 0).to(torch.int8).argsort(dim=1, stable=True)[:, :n_local]
            ids, weights = ids.gather(1, order), weights.gather(1, order)
        return moe_experts(x, self.w13, self.w2, ids, weights, activation=self.activation,
                           interleaved=self.interleaved, w13_bias=self.w13_bias, w2_bias=self.w2_bias,
                           shared_out=shared_out, mode=self.mode)

    def _local_ids(self, ids: torch.Tensor, rank: int | torch.Tensor) -> torch.Tensor:
        """Global ids -> this rank's local ids, -1 for experts of other ranks and for dropped pairs."""
        safe = ids.clamp(min=0).long()
        mine = (ids >= 0) & (self.owner_of[safe] == rank)
        return torch.where(mine, self.local_of[safe], torch.full_like(ids, -1, dtype=torch.int32)).to(torch.int32)

    def _all_gather(self, x, ids, weights):
        g, n = self.groups.ep_group, self.groups.ep
        T, H = x.shape
        counts = torch.tensor([T], dtype=torch.int64, device=x.device)
        all_counts = torch.empty(n, dtype=torch.int64, device=x.device)
        dist.all_gather_into_tensor(all_counts, counts, group=g)
        counts_host = all_counts.tolist()
        t_max = max(counts_host)
        if t_max == 0:
            return x.new_zeros(0, H)

        def gather(t, fill):
            pad = torch.full((t_max, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
            pad[:T] = t
            out = torch.empty((n * t_max, *t.shape[1:]), dtype=t.dtype, device=t.device)
            dist.all_gather_into_tensor(out, pad, group=g)
            return out

        xs, gid, gw = gather(x, 0), gather(ids.to(torch.int32), -1), gather(weights, 0)
        y = self._local(xs, self._local_ids(gid, self.groups.ep_rank), gw)
        out = torch.empty(t_max, H, dtype=y.dtype, device=y.device)
        red = self.reduce_dtype
        if red is None or red == y.dtype:
            dist.reduce_scatter_tensor(out, y.contiguous(), group=g)
            return out[:T]
        wide = torch.empty(t_max, H, dtype=red, device=y.device)
        dist.reduce_scatter_tensor(wide, y.to(red), group=g)
        return wide[:T].to(y.dtype)

    def _all_to_all(self, x, ids, weights):
        g, n = self.groups.ep_group, self.groups.ep
        T, H = x.shape
        safe = ids.clamp(min=0).long()
        dest = torch.where(ids >= 0, self.owner_of[safe], torch.full_like(safe, -1, dtype=torch.int32))
        ranks = torch.arange(n, device=x.device, dtype=torch.int32)
        sends = (dest[None, :, :] == ranks[:, None, None]).any(dim=2)  # [ranks, T]: token t goes to rank r
        send_rank, send_token = sends.nonzero(as_tuple=True)  # ordered by rank, then token
        send_counts = sends.sum(dim=1).to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=g)
        s, r = send_counts.tolist(), recv_counts.tolist()
        # the pairs of a token sent to rank q: q's local ids, -1 for the others
        sent_ids = torch.where(dest[send_token] == send_rank[:, None].to(torch.int32),
                               self.local_of[safe[send_token]], torch.full_like(dest[send_token], -1))

        def exchange(t, out_rows, out_splits, in_splits):
            out = torch.empty((out_rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
            dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=g)
            return out

        rx = exchange(x[send_token], sum(r), r, s)
        rid = exchange(sent_ids.to(torch.int32), sum(r), r, s)
        rw = exchange(weights[send_token], sum(r), r, s)
        y = self._local(rx, rid, rw) if sum(r) else x.new_zeros(0, H)
        red = self.reduce_dtype or y.dtype
        back = exchange(y.to(red), sum(s), s, r)
        out = torch.zeros(T, H, dtype=torch.float32 if red == torch.float32 else red, device=x.device)
        out.index_add_(0, send_token, back.to(out.dtype))
        return out.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens x [..., H] through the whole block (module docstring)."""
        H = self.hidden
        check_block_input(x, H)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, H)
        r = self.route(x2)
        ep = self.groups.ep_group
        replicated = ep is not None and self.dispatch == "replicated"
        # the shared expert: once per token (by expert-parallel rank 0 where every rank holds the tokens);
        # a sharded one's output is a partial sum over the tensor-parallel group, reduced with the experts
        s = self.shared(x2) if self._shared_sharded and (not replicated or self.groups.ep_rank == 0) else None
        if ep is None or replicated:  # the tokens stay: the shared output joins the experts' combine
            y = self._local(x2, self._local_ids(r.topk_ids, self.groups.ep_rank), r.topk_weights, s)
        else:
            y = (self._all_gather if self.dispatch == "all_gather" else self._all_to_all)(
                x2, r.topk_ids, r.topk_weights)
            y = y if s is None else y + s
        if replicated:
            y = all_reduce(y, ep, self.reduce_dtype)
        y = all_reduce(y, self.groups.tp_group, self.reduce_dtype)
        if not self._shared_sharded:  # a shared expert kept whole on every rank: added after the reductions
            y = y + self.shared(x2)
        self.last_stats = r.stats
        y = y.reshape(*lead, H)
        return (y, None) if self.returns_tuple else y


def shard_moe_blocks(model: nn.Module, groups: ParallelGroups, *, dispatch: Dispatch = "replicated",
                     placement: ExpertPlacement | Sequence[Sequence[int]] | None = None,
                     reduce_dtype: torch.dtype | None = None) -> list[str]:
    """Replace every :class:`fp4moe.nn.FP4MoE` of ``model`` (e.g. from ``load_fp4_model``) by this
    rank's :class:`ParallelFP4MoE`; returns the replaced modules' names.

    The rest of the model (attention, dense layers, embeddings) stays whole on every rank, so every
    rank runs the same tokens: ``dispatch="replicated"`` (the default) is the mode that fits; the
    experts, most of an MoE model's bytes, are split ``tp * ep`` ways.
    """
    names = [n for n, m in model.named_modules() if isinstance(m, FP4MoE)]
    if not names:
        raise ValueError(f"model: no fp4moe.nn.FP4MoE block in {type(model).__name__} (load it with "
                         "fp4moe's loader or quantize_model first)")
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        setattr(parent, child, ParallelFP4MoE(old, groups, dispatch=dispatch, placement=placement,
                                              reduce_dtype=reduce_dtype))
        del old
    return names
