"""``quantize_model``: a bf16 transformers model quantized to FP4 in memory, in place, on its device.

The same decisions as ``fp4moe quantize`` (``fp4moe.checkpoints.policy.quantize_decision``: every
Linear projection whose K is a multiple of 16; never embeddings, norms, routers or ``lm_head``) and
the same expert layout (gate, up and down of each expert quantized alone, then stacked), without a checkpoint on disk: each MoE block
becomes an :class:`FP4MoEBlock` and each quantized linear an :class:`fp4moe.nn.FP4Linear` (or, with
``linears=False``, stays a bf16 ``nn.Linear``). Each block's bf16 weights are released as soon as its
FP4 copy exists, so a model that fits the GPU in bf16 can be converted there. For benchmarks and
experiments on random or already-loaded models; checkpoints go through ``fp4moe quantize`` and
:func:`load_fp4_model`.
"""

from __future__ import annotations

import torch
from torch import nn

from ...checkpoints.policy import quantize_decision
from ...checkpoints.safetensors_io import dtype_name
from ...nn import FP4Linear, GatedMLP
from ...ops.linear import Mode
from ...checkpoints.stacking import stack_experts
from ...quantize import quantize
from .families import family_for
from .loader import FP4MoEBlock, fp4_block

__all__ = ["quantize_model"]

def _fp4_linear(linear: nn.Linear, fmt: str, mode: Mode) -> FP4Linear:
    return FP4Linear.from_linear(linear, fmt, mode=mode)


def _block(block: nn.Module, family, config, fmt: str, *, linears: bool, mode: Mode, k0: int | None) -> FP4MoEBlock:
    experts = block.experts
    w13, w2 = experts.gate_up_proj.detach(), experts.down_proj.detach()
    E, I, H = family.n_experts(config), family.intermediate(config), int(config.hidden_size)
    if tuple(w13.shape) != (E, 2 * I, H) or tuple(w2.shape) != (E, H, I):
        raise ValueError(f"{type(block).__name__}: expected experts gate_up_proj [{E}, {2 * I}, {H}] and down_proj "
                         f"[{E}, {H}, {I}], got {list(w13.shape)} and {list(w2.shape)}")
    # as a checkpoint stores them (each expert's gate, up and down quantized alone) and as the loader
    # stacks them: the same FP4 model as `fp4moe quantize` + load_fp4_model
    q13 = stack_experts([[quantize(w13[e, :I], fmt), quantize(w13[e, I:], fmt)] for e in range(E)]).to(w13.device)
    q2 = stack_experts([[quantize(w2[e], fmt)] for e in range(E)]).to(w2.device)
    router = getattr(block, family.router)
    dtype = router.weight.dtype if router.weight.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    selection = getattr(router, family.selection_bias).detach().float() if family.selection_bias else None
    shared = None
    if family.shared:
        mlp = getattr(block, family.shared)
        parts = [getattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")]
        shared = GatedMLP(*[_fp4_linear(p, fmt, mode) if linears else p for p in parts])
    return fp4_block(family, config, router.weight.detach().to(dtype), q13, q2,
                     router_bias=router.bias.detach().to(dtype) if family.router_bias else None,
                     selection_bias=selection, shared_expert=shared, mode=mode, k0=k0)


@torch.no_grad()
def quantize_model(model: nn.Module, fmt: str = "nvfp4", *, linears: bool = True, mode: Mode = "w4a16",
                   k0: int | None = None, exclude: tuple[str, ...] = ()) -> nn.Module:
    """Quantize ``model`` (a bf16/fp16 transformers causal LM of a family in ``FAMILIES`` other than
    gpt-oss, whose experts transformers keeps transposed) in place; returns it.

    Args:
        fmt: "nvfp4" or "mxfp4".
        linears: quantize the other Linear projections too (attention, dense MLPs, shared experts).
        mode: "w4a16" or "w4a4" (NVFP4).
        k0: opportunistic expert activation of the MoE blocks (``FP4MoE``).
        exclude: module-name patterns of linears to keep in bf16 (as ``fp4moe quantize --exclude``).
    """
    config = getattr(model, "config", None)
    family = family_for(getattr(config, "model_type", None), type(model).__name__)
    if family.name == "gpt_oss":
        raise ValueError("quantize_model: gpt-oss keeps its experts transposed and interleaved; quantize it with "
                         "`fp4moe quantize` and load it with load_fp4_model")
    family.check_config(model.config)
    blocks = [n for n, m in model.named_modules() if type(m).__name__ in family.block_classes]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no {'/'.join(family.block_classes)}: nothing to quantize")
    for name in blocks:
        fp4 = _block(model.get_submodule(name), family, model.config, fmt, linears=linears, mode=mode, k0=k0)
        model.set_submodule(name, fp4)  # the bf16 block is released here
    if linears:
        in_block = tuple(n + "." for n in blocks)
        for name, module in list(model.named_modules()):
            if not isinstance(module, nn.Linear) or type(module) is not nn.Linear or name.startswith(in_block):
                continue
            w = module.weight
            decision = quantize_decision(f"{name}.weight", dtype_name(w.dtype), tuple(w.shape), exclude)
            if decision.quantize:
                model.set_submodule(name, _fp4_linear(module, fmt, mode))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return model
