"""NVFP4 global scales as each checkpoint format stores them, and the one fp4moe uses.

fp4moe's global scale (``FP4Tensor.global_scale``) is a multiplier, ModelOpt's convention:
``W = e2m1(q) * block_scale * global`` with ``global = amax / (6 * 448)``; the activation
global (``input_scale``) likewise. compressed-tensors stores both INVERTED
(``weight_global_scale = 2688 / amax``, dequant divides): a reader that forgets is off by amax².

Inverting in fp32 is not always reversible: for 17% of fp32 values ``1/(1/g) != g`` (and no
fp32 ``w`` at all has ``1/w == g``). So that one bf16 model written in both formats reads back
to the very same FP4Tensors, the writer nudges such a global up by one ulp
(:func:`checkpoint_global_scale`, never more: the unreachable values are isolated).
"""

from __future__ import annotations

import math

import torch

from ..quantize import nvfp4_global_scale
from .errors import CheckpointError

__all__ = ["checkpoint_global_scale", "reciprocal_round_trips", "invert_stored_global", "check_global"]


def reciprocal_round_trips(g: torch.Tensor) -> bool:
    """Whether the fp32 value ``g`` survives ``1 / (1 / g)`` in fp32 (correctly rounded division)."""
    g = g.to(torch.float32)
    one = torch.ones_like(g)
    return bool(torch.equal(one / (one / g), g))


def checkpoint_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The global scale fp4moe writes for a tensor of absolute maximum ``amax`` (0-d fp32).

    ``nvfp4_global_scale(amax)`` (ModelOpt's ``amax / 2688``) when its reciprocal round-trips in
    fp32 (83% of values), else the next fp32 value up, whose reciprocal does. Up, so that no
    block scale exceeds 448. Stored as is (ModelOpt) or inverted (compressed-tensors), it reads
    back exactly.
    """
    g = nvfp4_global_scale(amax).reshape(())
    if reciprocal_round_trips(g):
        return g
    up = torch.nextafter(g, torch.tensor(math.inf, dtype=torch.float32))
    if not reciprocal_round_trips(up):  # pragma: no cover - exhaustively false for fp32 (see tests)
        raise AssertionError(f"no fp32 global scale next to {float(g)!r} survives inversion")
    return up


def check_global(value: torch.Tensor, where: str) -> torch.Tensor:
    """A stored global scale as a 0-d fp32 tensor; it must be one positive finite value."""
    if value.numel() != 1:
        raise CheckpointError(f"{where}: expected one value, found shape {list(value.shape)}")
    v = value.reshape(()).to(torch.float32)
    f = float(v)
    if not (f > 0 and math.isfinite(f)):
        raise CheckpointError(f"{where}: expected a positive finite global scale, found {f!r}")
    return v


def invert_stored_global(value: torch.Tensor, where: str) -> torch.Tensor:
    """compressed-tensors' ``weight_global_scale`` / ``input_global_scale`` (2688 / amax) to the
    multiplier fp4moe uses (amax / 2688): ``1 / stored`` in fp32."""
    v = check_global(value, where)
    return torch.ones_like(v) / v
