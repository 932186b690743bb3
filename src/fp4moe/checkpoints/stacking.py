"""Stacking per-expert FP4 linears into the FP4MoE layout, and global scales beyond one per tensor.

A stacked NVFP4 expert weight ``[E, N, K]`` cannot carry one global scale: each expert (and, in
ModelOpt and compressed-tensors checkpoints, each of gate and up) was quantized with its own, so
its FP4Tensor carries a per-expert ``[E, 1]`` or per-row ``[E, N]`` global.

Gate and up of one expert are merged under one global only when that is exact
(:func:`share_global`): the block scales of one of them are rescaled by the ratio of the two
globals, and every rescaled E4M3 scale must be representable, which holds for power-of-two
ratios away from the subnormals and rarely otherwise. When any expert of a layer cannot be
merged exactly, the layer keeps every row's own global (``[E, N]``) and its scales untouched.
Either way ``dequantize`` of the stack equals, bit for bit, the dequantized per-expert tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..quantize import FP4Tensor

__all__ = ["make_fp4", "share_global", "stack_experts"]


def make_fp4(data: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None, shape: Sequence[int],
             fmt) -> FP4Tensor:
    """The one place the checkpoint code builds an FP4Tensor (global: one value, [E, 1] or [E, N])."""
    return FP4Tensor(data=data, scales=scales, global_scale=global_scale, shape=torch.Size(shape), fmt=fmt)


def _rescale_exact(scales: torch.Tensor, g_from: torch.Tensor, g_to: torch.Tensor) -> torch.Tensor | None:
    """E4M3 scales ``s'`` with ``s' * g_to == s * g_from`` exactly (as real numbers), or None.

    Exact equality of the products makes every dequantized value identical: ``e2m1 * s`` is
    exact in fp32, so both sides round the same real number once.
    """
    if torch.equal(g_from, g_to):
        return scales
    s = scales.to(torch.float64)
    target = s * float(g_from)  # e4m3 (4 significant bits) * fp32 (24): exact in float64
    new = (target / float(g_to)).to(torch.float32).to(torch.float8_e4m3fn)
    if not torch.equal(new.to(torch.float64) * float(g_to), target):
        return None
    return new


def share_global(parts: Sequence[FP4Tensor]) -> tuple[list[torch.Tensor], torch.Tensor] | None:
    """Block scales of ``parts`` rescaled to one common global, exactly, or None.

    Tries each distinct global of the parts, largest first (rescaling towards a larger global
    shrinks scales, which cannot overflow 448).
    """
    globals_ = sorted({float(p.global_scale) for p in parts}, reverse=True)
    for candidate in globals_:
        g = torch.tensor(candidate, dtype=torch.float32)
        rescaled = [_rescale_exact(p.scales, p.global_scale.reshape(()).cpu(), g) for p in parts]
        if all(r is not None for r in rescaled):
            return rescaled, g  # type: ignore[return-value]
    return None


def stack_experts(experts: Sequence[Sequence[FP4Tensor]]) -> FP4Tensor:
    """Stack experts, each a list of 2-D FP4Tensors concatenated along rows (gate then up, or the
    down projection alone), into one FP4Tensor [E, N, K].

    NVFP4: global ``[E, 1]`` when every expert's parts share one global exactly (some block scales
    rescaled), else ``[E, N]``, each row keeping its own global and scales. MXFP4: no global.
    """
    first = experts[0][0]
    data = torch.stack([torch.cat([p.data for p in parts]) for parts in experts])
    shape = (len(experts), data.shape[1], first.shape[-1])
    merged = [share_global(parts) for parts in experts] if first.global_scale is not None else []
    if merged and all(m is not None for m in merged):
        scales = torch.stack([torch.cat(m[0]) for m in merged])  # type: ignore[index]
        gs: torch.Tensor | None = torch.stack([m[1].reshape(1) for m in merged])  # type: ignore[index]  # [E, 1]
    else:
        scales = torch.stack([torch.cat([p.scales for p in parts]) for parts in experts])
        gs = None if first.global_scale is None else torch.stack(
            [torch.cat([p.global_scale.reshape(1).to(torch.float32).expand(p.shape[0]) for p in parts])
             for parts in experts])  # [E, N]
    return make_fp4(data, scales, None if gs is None else gs.contiguous(), shape, first.fmt)
