"""``load_fp4_model``: a quantized checkpoint into its transformers model class, MoE blocks on fp4moe.

Order of work, so that nothing is half-loaded:

1. open the checkpoint (headers only) and build the model class from its ``config.json`` on the
   ``meta`` device (no memory, no random initialisation);
2. plan from the headers alone: every MoE block has its FP4 experts with the shapes the config
   says, every parameter and persistent buffer of the model has its tensor (or, for a Linear, its
   quantized linear) with the right shape and kind of dtype (floating point, integer or bool), and
   every tensor of the checkpoint is used. Any mismatch raises
   :class:`fp4moe.checkpoints.CheckpointError` naming the tensor, expected and found, before a
   byte of data is read;
3. read and build: each MoE block becomes an :class:`FP4MoEBlock` (``fp4moe.nn.FP4MoE``), each
   quantized Linear an :class:`fp4moe.nn.FP4Linear` (or, with ``linears=False``, an ``nn.Linear``
   holding the dequantized weight), everything else is assigned as stored; rotary buffers are
   recomputed by transformers' own initialiser;
4. only then is the model moved to its device and returned. An exception anywhere drops the
   half-built model; the caller never sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ...checkpoints import Checkpoint, CheckpointError, open_checkpoint
from ...nn import FP4Linear, FP4MoE, GatedMLP
from ...quantize import dequantize
from ...ops.linear import Mode
from .families import MoEFamily, family_for

__all__ = ["FP4MoEBlock", "LoadReport", "load_fp4_model", "transformers_config"]

_SHARED_PROJ = ("gate_proj", "up_proj", "down_proj")


class FP4MoEBlock(FP4MoE):
    """``FP4MoE`` with the call signature of the transformers block it replaces: gpt-oss's MLP
    returns ``(out, router_scores)``, whose second element its decoder layer discards (``None``
    here), the others return the tensor."""

    def __init__(self, *args, returns_tuple: bool = False, family: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.returns_tuple, self.family = returns_tuple, family

    def forward(self, x: torch.Tensor):
        y = super().forward(x)
        return (y, None) if self.returns_tuple else y

    def extra_repr(self) -> str:
        E, two_i, H = self.w13.shape
        return (f"family={self.family}, experts={E}, hidden={H}, intermediate={two_i // 2}, fmt={self.w13.fmt}, "
                f"routing={self.routing.kind}, top_k={self.routing.top_k}, mode={self.mode}")


@dataclass
class LoadReport:
    """What :func:`load_fp4_model` did (``model.fp4moe_report``)."""

    path: Path
    format: str
    family: str
    moe_blocks: list[str] = field(default_factory=list)
    fp4_linears: list[str] = field(default_factory=list)  # replaced by FP4Linear
    dequantized_linears: list[str] = field(default_factory=list)  # linears=False: nn.Linear, dequantized
    bf16_tensors: int = 0  # tensors loaded as stored


def transformers_config(ckpt: Checkpoint):
    """The transformers config of a checkpoint, without its quantization_config (fp4moe runs the
    quantized weights itself; transformers must not try to)."""
    from transformers import AutoConfig

    cfg = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise CheckpointError(f"{ckpt.path / 'config.json'}: no model_type; cannot pick a transformers model class")
    try:
        return AutoConfig.for_model(model_type, **cfg)
    except ValueError as err:
        raise CheckpointError(f"{ckpt.path / 'config.json'}: transformers does not know model_type "
                              f"{model_type!r} ({err})") from None


@dataclass
class _Plan:
    blocks: dict[str, nn.Module]  # MoE block name -> meta module
    fp4_linears: list[str]  # quantized linears (outside the MoE blocks' routed experts)
    plain: dict[str, torch.Tensor]  # state-dict key -> meta tensor, loaded as stored
    tied: set[str]


def _ckpt_modules(ckpt: Checkpoint) -> dict[str, dict]:
    return {m.name: m.tensors for m in ckpt.modules()}


def _check_shape(ckpt: Checkpoint, name: str, want: tuple[int, ...], what: str = "") -> None:
    info = ckpt.info(name)
    if tuple(info.shape) != tuple(want):
        raise CheckpointError(f"{info.file}: tensor {name!r}: expected shape {list(want)}{what} (from the model's "
                              f"config), found {info.describe()}")


def _dtype_class(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "floating-point" if dtype.is_floating_point else "integer"


def _check_dtype(ckpt: Checkpoint, name: str, want: torch.dtype) -> None:
    """A tensor loaded as stored must be of the kind of the model's parameter or buffer (floating
    point, integer or bool); a float of another width is cast as it is read (F32 into bf16)."""
    info = ckpt.info(name)
    found = info.torch_dtype
    if _dtype_class(found) != _dtype_class(want):
        raise CheckpointError(f"{info.file}: tensor {name!r}: expected a {_dtype_class(want)} tensor (the model's "
                              f"{want}), found {info.describe()}")


def _plan(ckpt: Checkpoint, model: nn.Module, family: MoEFamily) -> _Plan:
    config = model.config
    names = set(ckpt.tensor_names())
    modules = _ckpt_modules(ckpt)
    quantized = set(ckpt.linear_names())
    consumed: set[str] = set()
    blocks = {n: m for n, m in model.named_modules() if type(m).__name__ in family.block_classes}
    if not blocks:
        raise CheckpointError(f"{ckpt.path}: {type(model).__name__} built from this config has no "
                              f"{'/'.join(family.block_classes)} (no MoE layer): nothing for fp4moe to run")
    E, I, H = family.n_experts(config), family.intermediate(config), int(config.hidden_size)
    for prefix in blocks:
        if prefix not in ckpt.moe_layers():
            stored = [n for n in names if n.startswith(f"{prefix}.experts.")]
            why = "its experts are stored unquantized" if stored else "the checkpoint has no experts for it"
            raise CheckpointError(f"{ckpt.path}: MoE block {prefix!r}: {why}; fp4moe loads FP4 experts "
                                  "(quantize the model with `fp4moe quantize` first)")
        got = ckpt.expert_shape(prefix)
        if got != (E, I, H):
            raise CheckpointError(f"{ckpt.path}: {prefix}.experts: expected {E} experts of intermediate {I} and hidden "
                                  f"{H} (from the config), found {got[0]} x intermediate {got[1]} x hidden {got[2]}")
        consumed |= {n for n in names if n.startswith(f"{prefix}.experts.")}

    state = model.state_dict(keep_vars=True)
    in_block = lambda key: next((p for p in blocks if key.startswith(p + ".")), None)  # noqa: E731
    known_in_block = {f"{family.router}.weight"}
    if family.router_bias:
        known_in_block.add(f"{family.router}.bias")
    if family.selection_bias:
        known_in_block.add(f"{family.router}.{family.selection_bias}")
    if family.shared:
        known_in_block |= {f"{family.shared}.{p}.weight" for p in _SHARED_PROJ}
    for key in state:
        prefix = in_block(key)
        if prefix is not None:
            rest = key[len(prefix) + 1:]
            if rest.startswith("experts."):
                continue
            if rest not in known_in_block:
                raise CheckpointError(f"{type(model).__name__}: {key!r} is a part of the {family.name} MoE block that "
                                      "fp4moe does not know how to run")

    fp4_linears: list[str] = []
    plain: dict[str, torch.Tensor] = {}  # loaded as stored (outside the MoE blocks)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    for key, tensor in state.items():
        prefix = in_block(key)
        if prefix is not None and key[len(prefix) + 1:].startswith("experts."):
            continue
        inside = prefix is not None  # router and shared expert: read by _build_block
        module, leaf = key.rsplit(".", 1)
        if module in quantized and module in linears:
            if leaf == "weight":
                spec = ckpt.linear_shape(module)
                lin = linears[module]
                if spec != (lin.out_features, lin.in_features):
                    raise CheckpointError(f"{ckpt.path}: quantized linear {module!r}: expected [out, in] = "
                                          f"{[lin.out_features, lin.in_features]} (from the config), found {list(spec)}")
                if not inside:
                    fp4_linears.append(module)
                consumed |= {f"{module}.{s}" for s in modules[module]}
            elif leaf == "bias" and "bias" not in modules[module]:  # a quantized linear keeps its bias with it
                raise CheckpointError(f"{ckpt.path}: missing tensor {key!r} (the bias of quantized linear {module!r})")
            continue
        if key not in names:
            if key in tied:
                continue
            stored = [n for n in names if n.startswith(module + ".")]
            hint = f" (found {', '.join(sorted(stored)[:4])})" if stored else ""
            raise CheckpointError(f"{ckpt.path}: missing tensor {key!r}, expected {list(tensor.shape)} for "
                                  f"{type(model).__name__}{hint}")
        _check_shape(ckpt, key, tuple(tensor.shape))
        _check_dtype(ckpt, key, tensor.dtype)
        consumed.add(key)
        if not inside:
            plain[key] = tensor
    extra = sorted(names - consumed)
    if extra:
        info = ckpt.info(extra[0])
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"{info.file}: extra tensor {extra[0]!r} {info.describe()}{more}: "
                              f"{type(model).__name__} has no parameter it would load into")
    return _Plan(blocks, fp4_linears, plain, tied)


def _linear(ckpt: Checkpoint, name: str, dtype: torch.dtype, *, fp4: bool, mode: Mode) -> nn.Module:
    lw = ckpt.linear(name)
    bias = None if lw.bias is None else lw.bias.to(dtype)
    if fp4:  # a W4A4 checkpoint's calibrated activation scale, where the linear runs W4A4
        return FP4Linear.from_fp4(lw.weight, bias, mode=mode,
                                  input_scale=lw.input_global_scale if mode == "w4a4" else None)
    out_f, in_f = lw.weight.shape
    layer = nn.Linear(in_f, out_f, bias=bias is not None, dtype=dtype)
    layer.weight = nn.Parameter(dequantize(lw.weight, dtype), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


def _plain_linear(ckpt: Checkpoint, name: str, dtype: torch.dtype) -> nn.Linear:
    w = ckpt.tensor(f"{name}.weight").to(dtype)
    layer = nn.Linear(w.shape[1], w.shape[0], bias=f"{name}.bias" in ckpt.tensor_names(), dtype=dtype)
    layer.weight = nn.Parameter(w, requires_grad=False)
    if layer.bias is not None:
        layer.bias = nn.Parameter(ckpt.tensor(f"{name}.bias").to(dtype), requires_grad=False)
    return layer


def _build_block(ckpt: Checkpoint, prefix: str, family: MoEFamily, config, dtype: torch.dtype, *, fp4_linears: bool,
                 mode: Mode, k0: int | None, parallel=None) -> nn.Module:
    """The block at ``prefix``: an ``FP4MoEBlock``, or with ``parallel`` (groups, placement, dispatch)
    this rank's ``ParallelFP4MoE``, built from only the experts the rank owns."""
    r = f"{prefix}.{family.router}"
    router_weight = ckpt.tensor(f"{r}.weight").to(dtype)
    owned = None
    if parallel is not None:
        from ...distributed import ExpertPlacement

        groups, placement, _ = parallel
        placement = ExpertPlacement.of(placement, router_weight.shape[0], groups.ep)
        owned = placement.owners[groups.ep_rank]
    ex = ckpt.experts(prefix, owned)
    router_bias = ckpt.tensor(f"{r}.bias").to(dtype) if family.router_bias else None
    selection = ckpt.tensor(f"{r}.{family.selection_bias}").float() if family.selection_bias else None
    shared = None
    if family.shared:
        quantized = set(ckpt.linear_names())
        parts = [_linear(ckpt, m, dtype, fp4=fp4_linears, mode=mode) if m in quantized else _plain_linear(ckpt, m, dtype)
                 for m in (f"{prefix}.{family.shared}.{p}" for p in _SHARED_PROJ)]
        shared = GatedMLP(*parts)
    if parallel is not None:
        from ...distributed import BlockParts, ParallelFP4MoE

        parts = BlockParts(router_weight, ex.w13, ex.w2, family.routing(config), expert_ids=owned,
                           router_bias=router_bias, selection_bias=selection, shared_expert=shared,
                           w13_bias=None if ex.w13_bias is None else ex.w13_bias.to(dtype),
                           w2_bias=None if ex.w2_bias is None else ex.w2_bias.to(dtype), activation=family.activation,
                           interleaved=ex.layout == "interleaved", mode=mode, k0=k0,
                           router_dtype=torch.float32 if family.router_fp32 else None,
                           returns_tuple=family.returns_tuple)
        return ParallelFP4MoE(parts, groups, placement=placement, dispatch=parallel[2])
    return fp4_block(family, config, router_weight, ex.w13, ex.w2, router_bias=router_bias, selection_bias=selection,
                     shared_expert=shared, interleaved=ex.layout == "interleaved",
                     w13_bias=None if ex.w13_bias is None else ex.w13_bias.to(dtype),
                     w2_bias=None if ex.w2_bias is None else ex.w2_bias.to(dtype), mode=mode, k0=k0)


def fp4_block(family: MoEFamily, config, router_weight: torch.Tensor, w13, w2, *, mode: Mode, k0: int | None,
              router_bias: torch.Tensor | None = None, selection_bias: torch.Tensor | None = None,
              shared_expert: nn.Module | None = None, interleaved: bool = False,
              w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None) -> FP4MoEBlock:
    """The ``FP4MoEBlock`` of ``family`` (its routing, activation, router dtype and return form) on
    these parts: what a checkpoint's block (``_build_block``) and an in-memory one
    (``convert.quantize_model``) become."""
    return FP4MoEBlock(router_weight, w13, w2, family.routing(config), router_bias=router_bias,
                       selection_bias=selection_bias, activation=family.activation, interleaved=interleaved,
                       w13_bias=w13_bias, w2_bias=w2_bias, shared_expert=shared_expert,
                       router_dtype=torch.float32 if family.router_fp32 else None, mode=mode, k0=k0,
                       returns_tuple=family.returns_tuple, family=family.name)


def _materialize_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (rotary inv_freq) are not in checkpoints: allocate them and let
    transformers' initialiser compute them, as its own loader does."""
    for name, module in model.named_modules():
        meta = [b for b, t in module._buffers.items() if t is not None and t.is_meta]
        if not meta:
            continue
        if "RotaryEmbedding" not in type(module).__name__:
            raise CheckpointError(f"{type(model).__name__}: buffer {name}.{meta[0]} is not stored in checkpoints and "
                                  "fp4moe does not know how to compute it")
        for b in meta:
            module._buffers[b] = torch.empty_like(module._buffers[b], device="cpu")
        model._init_weights(module)


def load_fp4_model(path: str | Path, *, device: str | torch.device | None = None, dtype: torch.dtype = torch.bfloat16,
                   linears: bool = True, mode: Mode = "w4a16", k0: int | None = None, parallel=None,
                   placement=None, dispatch: str = "replicated"):
    """Load the quantized checkpoint in ``path`` into its transformers causal-LM class with every MoE
    block running on fp4moe.

    Args:
        path: a checkpoint fp4moe reads (``fp4moe quantize`` output, ModelOpt NVFP4, compressed-tensors
            nvfp4-pack-quantized, gpt-oss MXFP4) of a model type in
            ``fp4moe.integrations.transformers.FAMILIES``.
        device: where the model goes (default: CUDA when available, else CPU, where the kernels need
            ``TRITON_INTERPRET=1``).
        dtype: activations and unquantized weights (bfloat16 or float16).
        linears: the checkpoint's other quantized linears (attention, dense MLP, shared experts) become
            ``FP4Linear``; False dequantizes them into plain ``nn.Linear`` layers.
        mode: "w4a16" or "w4a4" (NVFP4 only: activations quantized per token).
        k0: opportunistic expert activation (``FP4MoE``), None for exact top-k.
        parallel: this rank's ``fp4moe.distributed.ParallelGroups`` (``make_groups(tp, ep)`` under
            ``torchrun``): every MoE block becomes the rank's ``ParallelFP4MoE``, and of the routed
            experts the rank reads only its own (``placement``, default contiguous) and keeps its
            share of each one's intermediate size; the rest of the model is loaded whole on every
            rank, which therefore runs the same tokens (``dispatch`` "replicated").

    Returns:
        The model in eval mode; ``model.fp4moe_report`` is a :class:`LoadReport`.
    Raises:
        CheckpointError for a bad or mismatched checkpoint, ValueError for a model type without an
        MoE block fp4moe knows, ImportError without transformers.
    """
    try:
        import transformers  # noqa: F401
        from transformers import AutoModelForCausalLM, GenerationConfig
    except ImportError:  # pragma: no cover - the [hf] extra
        raise ImportError("fp4moe.integrations.transformers needs transformers>=5.17,<6 "
                          "(pip install 'fp4moe[hf]')") from None
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: expected torch.bfloat16 or torch.float16, got {dtype}")
    if parallel is not None:
        from ...distributed import DISPATCH_MODES, ParallelGroups

        if not isinstance(parallel, ParallelGroups):
            raise TypeError(f"parallel: expected fp4moe.distributed.ParallelGroups (make_groups(tp, ep)), got "
                            f"{type(parallel).__name__}")
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch: expected one of {', '.join(DISPATCH_MODES)}, got {dispatch!r}")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    with open_checkpoint(path) as ckpt:
        if ckpt.format == "bf16":
            raise CheckpointError(f"{ckpt.path}: is not quantized; run `fp4moe quantize {ckpt.path} OUT_DIR` and load "
                                  "OUT_DIR, or load this folder with transformers itself")
        config = transformers_config(ckpt)
        family = family_for(config.model_type)
        family.check_config(config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        plan = _plan(ckpt, model, family)
        report = LoadReport(Path(path), ckpt.format, family.name, moe_blocks=list(plan.blocks))
        for prefix in plan.blocks:
            model.set_submodule(prefix, _build_block(
                ckpt, prefix, family, config, dtype, fp4_linears=linears, mode=mode, k0=k0,
                parallel=None if parallel is None else (parallel, placement, dispatch)))
        for name in plan.fp4_linears:
            model.set_submodule(name, _linear(ckpt, name, dtype, fp4=linears, mode=mode))
            (report.fp4_linears if linears else report.dequantized_linears).append(name)
        state = {key: ckpt.tensor(key).to(meta.dtype) for key, meta in plan.plain.items()}
        model.load_state_dict(state, strict=False, assign=True)
        report.bf16_tensors = len(state)
    if plan.tied:
        model.tie_weights()
    _materialize_buffers(model)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # pragma: no cover - a planning bug; never hand out a half-loaded model
        raise CheckpointError(f"{path}: {left[0]} was not loaded ({len(left)} tensors left)")
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass
    model.fp4moe_report = report
    return model.to(device).eval()
