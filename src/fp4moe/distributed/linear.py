"""Tensor-parallel FP4 linears: column-parallel (each rank its output features) and row-parallel
(each rank its input features, one all-reduce of the output).

A column shard is an ordinary :class:`fp4moe.nn.FP4Linear` of the rank's rows (and bias slice);
its output is the rank's slice of the features, what a following row-parallel layer takes as
input. A row shard cuts K on block-scale boundaries (``shard.shard_k``); the partial outputs are
summed by one all-reduce and the bias is added once, after it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..nn import FP4Linear
from .shard import shard_k, shard_range, shard_rows

__all__ = ["RowParallelFP4Linear", "column_parallel", "row_parallel"]


def _check_linear(linear: nn.Module) -> FP4Linear:
    if not isinstance(linear, FP4Linear):
        raise TypeError(f"linear: expected an fp4moe.nn.FP4Linear, got {type(linear).__name__}")
    return linear


def column_parallel(linear: FP4Linear, parts: int, index: int) -> FP4Linear:
    """Rank ``index``'s output features of ``linear`` (``out_features / parts`` rows and their bias)."""
    _check_linear(linear)
    rows = shard_range(linear.out_features, parts, index, what=f"out_features of {linear}")
    bias = None if linear.bias is None else linear.bias.detach()[rows]
    return FP4Linear.from_fp4(shard_rows(linear.weight_fp4, rows), bias, mode=linear.mode,
                              input_scale=linear.input_scale)


class RowParallelFP4Linear(nn.Module):
    """Rank ``index``'s input features of a linear: ``y = all_reduce(x_shard @ W_shard^T) + b``.

    ``x`` is this rank's slice of the input features (what a column-parallel layer before it
    returns). ``reduce_dtype``: the dtype of the all-reduce (default: x's; float32 sums the partial
    outputs before rounding them once, at twice the bytes).
    """

    def __init__(self, local: FP4Linear, bias: torch.Tensor | None, group, *, reduce_dtype: torch.dtype | None = None):
        super().__init__()
        self.local, self.group, self.reduce_dtype = local, group, reduce_dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        y = all_reduce(y, self.group, self.reduce_dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def all_reduce(y: torch.Tensor, group, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The sum of ``y`` over ``group`` (y itself where the group is None), reduced in ``reduce_dtype``."""
    if group is None:
        return y
    if reduce_dtype is None or reduce_dtype == y.dtype:
        y = y.contiguous()
        dist.all_reduce(y, group=group)
        return y
    t = y.to(reduce_dtype)
    dist.all_reduce(t, group=group)
    return t.to(y.dtype)


def row_parallel(linear: FP4Linear, parts: int, index: int, group, *,
                 reduce_dtype: torch.dtype | None = None) -> RowParallelFP4Linear:
    """Rank ``index``'s input features of ``linear``, summed over ``group`` (``parts`` ranks)."""
    _check_linear(linear)
    local = FP4Linear.from_fp4(shard_k(linear.weight_fp4, parts, index), None, mode=linear.mode,
                               input_scale=linear.input_scale)
    return RowParallelFP4Linear(local, None if linear.bias is None else linear.bias.detach(), group,
                                reduce_dtype=reduce_dtype)
