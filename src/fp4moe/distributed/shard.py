"""Cutting FP4 weights into per-rank shards, and which rank owns which expert.

Pure tensor slicing: nothing here talks to other processes, so the same functions cut a weight
held in memory and a slice read from a checkpoint.

* **Rows** (the output axis N of ``[..., N, K]``: a column-parallel linear, each expert's gate/up
  rows) are independent: a shard is the rows, their block scales and, where the global scale is
  per row, its rows; a per-tensor or per-expert global scale is kept as it is, so every shard
  dequantizes to exactly the values the full weight holds.
* **K** (the input axis: a row-parallel linear, each expert's down projection) is cut on
  block-scale boundaries only (16 elements for NVFP4, 32 for MXFP4), so no block is split and, again,
  every value is exact.
* **Experts** (the leading axis of stacked ``[E, N, K]`` weights) are cut by an
  :class:`ExpertPlacement`: contiguous ranges by default or an explicit list per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..quantize import FP4Tensor

__all__ = ["ExpertPlacement", "shard_gate_up", "shard_k", "shard_range", "shard_rows", "take_experts"]


def shard_range(n: int, parts: int, index: int, *, multiple: int = 1, what: str) -> slice:
    """The ``index``-th of ``parts`` equal slices of ``range(n)``, each a multiple of ``multiple``."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"{what}: expected 0 <= index < parts, got index {index} of {parts}")
    if n % parts or (n // parts) % multiple:
        raise ValueError(f"{what}: {n} does not split into {parts} equal shards that are multiples of {multiple} "
                         f"(got {n / parts:g} per shard)")
    size = n // parts
    return slice(index * size, (index + 1) * size)


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that keeps nothing of the full tensor alive."""
    return t.clone(memory_format=torch.contiguous_format)


def _global_rows(t: FP4Tensor, axis: int, index) -> torch.Tensor | None:
    """The global scale of a slice along leading ``axis``: sliced where it holds one value per entry of
    that axis, kept where it broadcasts."""
    g = t.global_scale
    lead = len(t.shape) - 1
    if g is None or g.dim() != lead or g.shape[axis] == 1:
        return g
    return _own(g[(slice(None),) * axis + (index,)])


def shard_rows(t: FP4Tensor, rows: slice | torch.Tensor) -> FP4Tensor:
    """The rows ``rows`` (a slice or an index tensor) of the output axis N of ``t`` [..., N, K]."""
    axis = len(t.shape) - 2
    if axis < 0:
        raise ValueError(f"t: expected at least 2 dimensions [..., N, K], got {tuple(t.shape)}")
    pre = (slice(None),) * axis
    data, scales = _own(t.data[pre + (rows,)]), _own(t.scales[pre + (rows,)])
    shape = (*t.shape[:axis], data.shape[axis], t.shape[-1])
    return FP4Tensor(data=data, scales=scales, global_scale=_global_rows(t, axis, rows), shape=shape, fmt=t.fmt)


def shard_k(t: FP4Tensor, parts: int, index: int) -> FP4Tensor:
    """The ``index``-th of ``parts`` equal slices of the input axis K of ``t`` [..., N, K], cut on
    block-scale boundaries (every value exact)."""
    K, block = t.shape[-1], t.fmt.block_size
    cols = shard_range(K, parts, index, multiple=block, what=f"K of {tuple(t.shape)} ({t.fmt} blocks of {block})")
    data = _own(t.data[..., cols.start // 2:cols.stop // 2])
    scales = _own(t.scales[..., cols.start // block:cols.stop // block])
    g = None if t.global_scale is None else _own(t.global_scale)
    return FP4Tensor(data=data, scales=scales, global_scale=g, shape=(*t.shape[:-1], cols.stop - cols.start),
                     fmt=t.fmt)


def shard_gate_up(w13: FP4Tensor | torch.Tensor, parts: int, index: int, *, interleaved: bool = False,
                  block: int = 1):
    """Rank ``index``'s share of each expert's fused gate and up rows (``w13`` [..., 2I, K], or a bias
    [..., 2I]): gate rows then up rows (``interleaved=False``) give the matching slices of both
    halves, concatenated in the same order; interleaved rows (gpt-oss: gate, up, gate, up, ...) a
    contiguous slice of whole pairs. ``block``: each half's shard must be a multiple of it."""
    is_fp4 = isinstance(w13, FP4Tensor)
    axis = len(w13.shape) - (2 if is_fp4 else 1)
    two_i = w13.shape[axis]
    if two_i % 2:
        raise ValueError(f"w13: expected an even number of gate+up rows, got {two_i}")
    I = two_i // 2
    half = shard_range(I, parts, index, multiple=block, what=f"I (intermediate size) of {tuple(w13.shape)}")
    if interleaved:
        rows = torch.arange(2 * half.start, 2 * half.stop)
    else:
        rows = torch.cat([torch.arange(half.start, half.stop), torch.arange(I + half.start, I + half.stop)])
    if is_fp4:
        return shard_rows(w13, rows.to(w13.data.device))
    return _own(w13[(slice(None),) * axis + (rows.to(w13.device),)])


def take_experts(t: FP4Tensor | torch.Tensor | None, experts: torch.Tensor):
    """The experts ``experts`` (global ids, in order) of a stacked weight [E, ...] or bias [E, ...]."""
    if t is None:
        return None
    if not isinstance(t, FP4Tensor):
        return _own(t[experts.to(t.device)])
    idx = experts.to(t.data.device)
    g = t.global_scale
    if g is not None and g.dim() == len(t.shape) - 1 and g.shape[0] == t.shape[0]:
        g = _own(g[idx])
    elif g is not None:
        g = _own(g)
    return FP4Tensor(data=_own(t.data[idx]), scales=_own(t.scales[idx]), global_scale=g,
                     shape=(len(experts), *t.shape[1:]), fmt=t.fmt)


@dataclass(frozen=True)
class ExpertPlacement:
    """Which expert-parallel rank owns which expert: ``owners[r]`` are rank r's global expert ids,
    in the order of its local weights. Every expert has exactly one owner and every rank at least one
    expert."""

    n_experts: int
    owners: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        owners = tuple(tuple(int(e) for e in ids) for ids in self.owners)
        object.__setattr__(self, "owners", owners)
        if not owners:
            raise ValueError("placement: expected at least one rank")
        seen: dict[int, int] = {}
        for r, ids in enumerate(owners):
            if not ids:
                raise ValueError(f"placement: rank {r} owns no expert (every rank needs at least one)")
            for e in ids:
                if not 0 <= e < self.n_experts:
                    raise ValueError(f"placement: rank {r} lists expert {e}, outside [0, {self.n_experts})")
                if e in seen:
                    raise ValueError(f"placement: expert {e} is owned by ranks {seen[e]} and {r}")
                seen[e] = r
        missing = sorted(set(range(self.n_experts)) - seen.keys())
        if missing:
            raise ValueError(f"placement: experts {missing[:8]}{'...' if len(missing) > 8 else ''} have no owner")

    @classmethod
    def contiguous(cls, n_experts: int, ranks: int) -> ExpertPlacement:
        """Rank r owns experts [r*E/ranks, (r+1)*E/ranks) (the first E % ranks ranks one more)."""
        if ranks < 1 or ranks > n_experts:
            raise ValueError(f"ranks: expected 1 to {n_experts} (the expert count), got {ranks}")
        base, extra = divmod(n_experts, ranks)
        owners, start = [], 0
        for r in range(ranks):
            n = base + (r < extra)
            owners.append(tuple(range(start, start + n)))
            start += n
        return cls(n_experts, tuple(owners))

    @classmethod
    def of(cls, placement: ExpertPlacement | Sequence[Sequence[int]] | None, n_experts: int,
           ranks: int) -> ExpertPlacement:
        """``placement`` as given (a placement or a list of expert ids per rank), or contiguous."""
        if placement is None:
            return cls.contiguous(n_experts, ranks)
        p = placement if isinstance(placement, ExpertPlacement) else cls(n_experts, tuple(map(tuple, placement)))
        if p.n_experts != n_experts or len(p.owners) != ranks:
            raise ValueError(f"placement: expected {n_experts} experts over {ranks} ranks, got {p.n_experts} "
                             f"experts over {len(p.owners)} ranks")
        return p

    def owner_table(self) -> torch.Tensor:
        """int32 [E]: the rank that owns each expert."""
        t = torch.empty(self.n_experts, dtype=torch.int32)
        for r, ids in enumerate(self.owners):
            t[list(ids)] = r
        return t

    def local_table(self) -> torch.Tensor:
        """int32 [E]: each expert's index among its owner's local experts."""
        t = torch.empty(self.n_experts, dtype=torch.int32)
        for ids in self.owners:
            t[list(ids)] = torch.arange(len(ids), dtype=torch.int32)
        return t
