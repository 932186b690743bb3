"""The tensor- and expert-parallel process groups of one rank.

``world = tp * ep`` ranks; rank ``ep_rank * tp + tp_rank`` (tensor parallelism innermost, so that a
tensor-parallel group is neighbouring GPUs, the ones an NVLink island or a PCIe switch joins). A
tensor-parallel group's ranks hold the same tokens and split every weight; an expert-parallel
group's ranks hold different tokens (or the same ones, see ``dispatch`` in
:mod:`fp4moe.distributed.moe`) and split the experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["ParallelGroups", "make_groups"]


@dataclass(frozen=True)
class ParallelGroups:
    """One rank's place: ``tp_rank`` of ``tp`` in ``tp_group``, ``ep_rank`` of ``ep`` in ``ep_group``
    (a group is None where its size is 1: nothing to communicate)."""

    tp: int = 1
    ep: int = 1
    tp_rank: int = 0
    ep_rank: int = 0
    tp_group: Any = None
    ep_group: Any = None

    def __post_init__(self) -> None:
        for name in ("tp", "ep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if not 0 <= self.tp_rank < self.tp or not 0 <= self.ep_rank < self.ep:
            raise ValueError(f"ranks: expected tp_rank < tp and ep_rank < ep, got tp_rank {self.tp_rank} of "
                             f"{self.tp}, ep_rank {self.ep_rank} of {self.ep}")
        for size, group, name in ((self.tp, self.tp_group, "tp_group"), (self.ep, self.ep_group, "ep_group")):
            if size > 1 and group is None:
                raise ValueError(f"{name}: a group of {size} ranks needs a process group (fp4moe.distributed."
                                 "make_groups makes them)")


def make_groups(tp: int = 1, ep: int = 1) -> ParallelGroups:
    """This rank's groups in the initialized default process group of ``tp * ep`` ranks.

    Every rank must call it (with the same sizes): each new group is made collectively.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("make_groups: torch.distributed is not initialized (call "
                           "torch.distributed.init_process_group first, e.g. under torchrun)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(tp, bool) or isinstance(ep, bool) or not isinstance(tp, int) or not isinstance(ep, int) \
            or tp < 1 or ep < 1:
        raise ValueError(f"tp, ep: expected positive ints, got tp={tp!r}, ep={ep!r}")
    if tp * ep != world:
        raise ValueError(f"tp * ep: expected the world size {world}, got tp={tp} x ep={ep} = {tp * ep}")
    tp_group = ep_group = None
    for e in range(ep):  # every rank makes every group, in the same order
        g = dist.new_group(list(range(e * tp, (e + 1) * tp))) if tp > 1 else None
        if e == rank // tp:
            tp_group = g
    for t in range(tp):
        g = dist.new_group(list(range(t, world, tp))) if ep > 1 else None
        if t == rank % tp:
            ep_group = g
    return ParallelGroups(tp=tp, ep=ep, tp_rank=rank % tp, ep_rank=rank // tp, tp_group=tp_group, ep_group=ep_group)
