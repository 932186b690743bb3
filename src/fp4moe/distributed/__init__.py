"""Tensor and expert parallelism on ``torch.distributed``: FP4 linears and MoE blocks split over
ranks (NCCL on GPUs, gloo on CPU), launched with ``torchrun``.

* :func:`make_groups` - this rank's tensor- and expert-parallel process groups;
* :class:`ParallelFP4MoE` - an :class:`fp4moe.nn.FP4MoE` split over them (experts partitioned,
  each expert's intermediate size split, or both; three token dispatch modes);
* :func:`shard_moe_blocks` - every such block of a model (a transformers model from
  ``load_fp4_model``) replaced by this rank's part;
* :func:`column_parallel`, :func:`row_parallel` - an :class:`fp4moe.nn.FP4Linear` split by output or
  input features;
* :mod:`fp4moe.distributed.shard` - the slicing itself (block-scale boundaries, exact values) and
  :class:`ExpertPlacement`.
"""

from .groups import ParallelGroups, make_groups
from .linear import RowParallelFP4Linear, column_parallel, row_parallel
from .moe import DISPATCH_MODES, BlockParts, ParallelFP4MoE, shard_moe_blocks
from .shard import ExpertPlacement

__all__ = ["BlockParts", "DISPATCH_MODES", "ExpertPlacement", "ParallelFP4MoE", "ParallelGroups", "RowParallelFP4Linear",
           "column_parallel", "make_groups", "row_parallel", "shard_moe_blocks"]
