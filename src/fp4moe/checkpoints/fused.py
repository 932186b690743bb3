"""Fused expert tensors (transformers v5) and how the writer splits them into per-expert linears.

transformers v5 keeps a MoE layer's routed experts as two 3-D parameters of one ``experts``
module, and some models save them that way (gpt-oss always; others when their state dict is
written directly):

==============================  =======================  ======================  =====================
model_type                      ``experts.gate_up_proj``  ``experts.down_proj``   gate / up
==============================  =======================  ======================  =====================
default (Qwen3-MoE, DeepSeek-V3,  [E, 2I, H] (``x @ W^T``)  [E, H, I]               gate rows [0, I),
GLM-4.5 / GLM-5, Mixtral, ...)                                                       up rows [I, 2I)
``gpt_oss``                     [E, H, 2I] (``x @ W``)    [E, I, H]               interleaved: gate
                                                                                    even columns, up odd
==============================  =======================  ======================  =====================

plus optional ``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias`` [E, H] (gpt-oss), in the same
gate/up order as the weight.

The writer stores such a layer the way ModelOpt and compressed-tensors store experts, one linear
per expert and projection (``experts.<e>.gate_proj``, ``up_proj``, ``down_proj``, [N, K] with K
the reduction axis, biases as each linear's ``bias``), each quantized with its own global scale.
The reader then stacks them like any per-expert checkpoint (gate rows then up rows), so a fused
model and its per-expert twin give the same checkpoint bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .errors import CheckpointError
from .safetensors_io import TensorInfo

__all__ = ["FusedLayout", "FUSED_LAYOUTS", "FUSED_NAMES", "fused_layout", "check_fused", "split_fused"]

#: Tensor names (leaves of an ``experts`` module) that hold fused experts.
FUSED_NAMES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


@dataclass(frozen=True)
class FusedLayout:
    """How one model family lays out its fused expert weights (module docstring)."""

    transposed: bool  # weights stored [E, K, N] (x @ W) instead of [E, N, K]
    interleaved: bool  # gate on even, up on odd gate_up outputs instead of two halves


DEFAULT_LAYOUT = FusedLayout(transposed=False, interleaved=False)
#: model_type -> layout, where it is not the default; read from transformers 5.17's modeling files.
FUSED_LAYOUTS: dict[str, FusedLayout] = {"gpt_oss": FusedLayout(transposed=True, interleaved=True)}


def fused_layout(model_type: str | None) -> FusedLayout:
    return FUSED_LAYOUTS.get(str(model_type), DEFAULT_LAYOUT)


def _where(info: TensorInfo) -> str:
    return f"{info.file}: tensor {info.name!r}"


def check_fused(module: str, tensors: Mapping[str, TensorInfo], layout: FusedLayout,
                model_type: str | None) -> tuple[int, int, int]:
    """Check the fused tensors of ``module`` (suffix -> header); returns (E, I, H)."""
    for needed in ("gate_up_proj", "down_proj"):
        if needed not in tensors:
            first = next(iter(tensors.values()))
            raise CheckpointError(f"{first.file}: missing tensor {module + '.' + needed!r}; fused experts store "
                                  "gate_up_proj and down_proj (and optionally their _bias)")
    gu, down = tensors["gate_up_proj"], tensors["down_proj"]
    for info in (gu, down):
        if len(info.shape) != 3 or info.dtype not in ("BF16", "F16", "F32"):
            raise CheckpointError(f"{_where(info)}: expected a 3-D bf16/fp16/fp32 fused expert weight, found "
                                  f"{info.describe()}")
    which = f"model_type {model_type!r}" if model_type in FUSED_LAYOUTS else "the transformers v5 default"
    if layout.transposed:
        e, h, two_i = gu.shape
        want_down = (e, two_i // 2, h)
        how = "gate_up_proj [E, H, 2I], down_proj [E, I, H]"
    else:
        e, two_i, h = gu.shape
        want_down = (e, h, two_i // 2)
        how = "gate_up_proj [E, 2I, H], down_proj [E, H, I]"
    if two_i % 2 or down.shape != want_down:
        raise CheckpointError(f"{_where(down)}: expected {down.dtype}{list(want_down)} next to gate_up_proj "
                              f"{gu.describe()} ({which}: {how}), found {down.describe()}")
    i = two_i // 2
    for suffix, want in (("gate_up_proj_bias", (e, two_i)), ("down_proj_bias", (e, h))):
        info = tensors.get(suffix)
        if info is not None and (info.shape != want or info.dtype not in ("BF16", "F16", "F32")):
            raise CheckpointError(f"{_where(info)}: expected a float bias {list(want)}, found {info.describe()}")
    extra = [s for s in tensors if s not in FUSED_NAMES]
    if extra:
        raise CheckpointError(f"{_where(tensors[extra[0]])}: extra tensor in the fused experts {module!r}, which "
                              f"store {', '.join(FUSED_NAMES)}")
    return e, i, h


def split_fused(suffix: str, tensor: torch.Tensor, layout: FusedLayout) -> list[tuple[torch.Tensor, ...]]:
    """Per expert: (gate, up) [I, K]-weights or biases for ``gate_up_proj[_bias]``, (down,) for
    ``down_proj[_bias]``; weights come out [N, K] and contiguous."""
    bias = suffix.endswith("_bias")
    out = []
    for e in range(tensor.shape[0]):
        t = tensor[e]
        if not bias and layout.transposed:
            t = t.t()
        if suffix.startswith("gate_up"):
            if layout.interleaved:
                parts = (t[0::2], t[1::2])
            else:
                half = t.shape[0] // 2
                parts = (t[:half], t[half:])
        else:
            parts = (t,)
        out.append(tuple(p.contiguous() for p in parts))
    return out
