"""The reduction after a split-K linear: the fp32 partial sums of the K splits added in a fixed order
(bias and cast there). Shared by every kernel of the plain linear that splits K over programs."""

from __future__ import annotations

import torch

from ._runtime import arch_kwargs


def reduce_splits(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``out[M, N] = sum over s of part[s] (+ bias)``, fp32 partials [S, M, N] added in split order
    (``kernels.linear.splitk_reduce_kernel``): the second launch of every split-K linear (the
    Triton kernel of ``ops.linear``, the mma.sync and wgmma kernels of ``ops.mma_sync`` and
    ``ops.wgmma``)."""
    import triton

    from ..kernels.linear import splitk_reduce_kernel

    S, M, N = part.shape
    splitk_reduce_kernel[(M, triton.cdiv(N, 1024))](
        part, bias if bias is not None else out, out, M, N, out.stride(0), SPLIT_K=S, BLOCK=1024,
        HAS_BIAS=bias is not None, num_warps=4, **arch_kwargs(out.device))
    return out
