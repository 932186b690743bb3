"""``Checkpoint``: a quantized (or bf16) Hugging Face model folder, read lazily tensor by tensor.

Opening a checkpoint reads only ``config.json``, the quantization config and the safetensors
headers, and checks them all: the format is one fp4moe reads, every quantized linear has each
tensor its format needs with the right dtype and shape and nothing else, every MoE layer has all
its experts with consistent shapes. A checkpoint that opens is complete; tensors are then read
on demand (``linear``, ``experts``, ``tensor``), each read checked before anything is returned.

Tensor names per quantized linear ``M`` (N outputs, K inputs):

=====================  ======================  ==========================  ==============
                       ModelOpt                compressed-tensors          shape, dtype
=====================  ======================  ==========================  ==============
packed E2M1 codes      ``M.weight``            ``M.weight_packed``         [N, K/2] U8
block scales           ``M.weight_scale``      ``M.weight_scale``          [N, K/16] E4M3
weight global          ``M.weight_scale_2``    ``M.weight_global_scale``   1 value, F32
activation global      ``M.input_scale``       ``M.input_global_scale``    1 value, F32
=====================  ======================  ==========================  ==============

compressed-tensors globals are inverted (2688/amax); :meth:`Checkpoint.linear` returns them as
the multipliers fp4moe uses (amax/2688), like ModelOpt's. gpt-oss stores each MoE layer's experts
as ``experts.gate_up_proj_blocks`` [E, 2I, H/32, 16], ``_scales`` [E, 2I, H/32] (E8M0), and
``down_proj_*`` likewise, gate and up rows interleaved (gate on even rows), bf16 biases.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from ..formats import MXFP4, NVFP4, e4m3_is_nan, invalid_scale_codes
from ..quantize import FP4Tensor
from .errors import CheckpointError
from .policy import match_exclude, module_of
from .safetensors_io import FLOAT_DTYPES, ShardSet, TensorInfo, natural_key, read_json
from .scales import check_global, invert_stored_global
from .schemes import CheckpointFormat, Scheme, detect_scheme
from .stacking import make_fp4, stack_experts

__all__ = ["Checkpoint", "LinearWeights", "ExpertWeights", "ModuleEntry", "open_checkpoint"]

ExpertLayout = Literal["gate_up", "interleaved"]


@dataclass(frozen=True)
class _LinearNames:
    """Tensor suffixes of one quantized linear in a format."""

    label: str
    weight: str
    scale: str
    global_: str
    input: str
    optional: tuple[str, ...]  # allowed besides the four (checked where known)

    @property
    def quant_only(self) -> tuple[str, ...]:
        return (self.scale, self.global_, self.input)


MODELOPT = _LinearNames("ModelOpt NVFP4", "weight", "weight_scale", "weight_scale_2", "input_scale",
                        optional=("bias", "k_scale", "v_scale"))
COMPRESSED_TENSORS = _LinearNames("compressed-tensors nvfp4-pack-quantized", "weight_packed", "weight_scale",
                                  "weight_global_scale", "input_global_scale", optional=("bias", "weight_shape"))
_NAMES: dict[str, _LinearNames] = {"modelopt": MODELOPT, "compressed-tensors": COMPRESSED_TENSORS}

GPT_OSS_REQUIRED = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
GPT_OSS_OPTIONAL = ("gate_up_proj_bias", "down_proj_bias")
#: Suffixes that only a quantized checkpoint has (a bf16 folder holding them is mislabelled).
QUANTIZED_SUFFIXES = frozenset({"weight_scale", "weight_scale_2", "input_scale", "weight_packed",
                                "weight_global_scale", "input_global_scale", *GPT_OSS_REQUIRED})

_EXPERT = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


@dataclass(frozen=True)
class LinearWeights:
    """One quantized linear: ``y = x @ dequantize(weight)^T + bias``."""

    weight: FP4Tensor  # [N, K], global scale a multiplier (amax / 2688)
    bias: torch.Tensor | None  # [N]
    input_global_scale: torch.Tensor | None  # 0-d fp32 (activation amax / 2688), W4A4 checkpoints only


@dataclass(frozen=True)
class ExpertWeights:
    """The routed experts of one MoE layer, stacked in the FP4MoE layout.

    ``w13`` [E, 2I, H]: with ``layout`` "gate_up", rows [0, I) are gate and [I, 2I) up; with
    "interleaved" (gpt-oss), gate rows are even and up rows odd. ``w2`` [E, H, I]. NVFP4 stacks
    carry a per-expert global ``[E, 1]``, or per row ``[E, N]`` where gate and up could not
    share one exactly (see ``fp4moe.checkpoints.stacking``).
    """

    w13: FP4Tensor
    w2: FP4Tensor
    w13_bias: torch.Tensor | None  # [E, 2I], same row order as w13
    w2_bias: torch.Tensor | None  # [E, H]
    layout: ExpertLayout
    w13_input_scale: torch.Tensor | None = None  # [E] fp32: per expert, max of gate's and up's
    w2_input_scale: torch.Tensor | None = None  # [E] fp32

    @property
    def n_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate(self) -> int:
        return self.w2.shape[2]


@dataclass(frozen=True)
class ModuleEntry:
    """A module of the checkpoint and its tensors (suffix -> header info)."""

    name: str
    kind: Literal["nvfp4_linear", "mxfp4_experts", "tensors"]
    tensors: Mapping[str, TensorInfo]
    excluded: bool


@dataclass(frozen=True)
class _LinearSpec:
    module: str
    n: int
    k: int
    tensors: Mapping[str, TensorInfo]


@dataclass(frozen=True)
class _MoELayer:
    prefix: str
    n_experts: int
    hidden: int
    intermediate: int
    quantized: bool
    experts: tuple[tuple[str, str, str], ...] = ()  # (gate, up, down) module names; empty for gpt-oss
    packed: str = ""  # gpt-oss experts module


def _where(info: TensorInfo) -> str:
    return f"{info.file}: tensor {info.name!r}"


def _expect(info: TensorInfo, dtypes: tuple[str, ...], shape: tuple[int, ...] | None, what: str = "") -> None:
    ok_dtype = info.dtype in dtypes
    ok_shape = shape is None or info.shape == shape
    if not (ok_dtype and ok_shape):
        want_dtype = dtypes[0] if len(dtypes) == 1 else "|".join(dtypes)
        want = f"{want_dtype}{list(shape)}" if shape is not None else f"{want_dtype}[...]"
        raise CheckpointError(f"{_where(info)}: expected {want}{what}, found {info.describe()}")


def _expect_scalar(info: TensorInfo, what: str) -> None:
    if info.dtype != "F32" or info.numel != 1 or len(info.shape) > 1:
        raise CheckpointError(f"{_where(info)}: expected one F32 value ({what}, shape [] or [1]), "
                              f"found {info.describe()}")


class Checkpoint:
    """A model folder: config, quantization scheme, lazily read tensors (see the module doc).

    Use as a context manager or call :meth:`close` to release the file mappings.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a folder (expected a Hugging Face model folder with config.json "
                                  "and safetensors files)")
        self.config: dict = read_json(self.path / "config.json", what="the model's Hugging Face config")
        self.scheme: Scheme = detect_scheme(self.path, self.config)
        self._files = ShardSet(self.path)
        self._modules: dict[str, dict[str, TensorInfo]] = {}
        for info in sorted(self._files.tensors.values(), key=lambda t: natural_key(t.name)):
            module = module_of(info.name)
            suffix = info.name[len(module) + 1:] if module != info.name else info.name
            self._modules.setdefault(module, {})[suffix] = info
        self._linears: dict[str, _LinearSpec] = {}
        self._moe: dict[str, _MoELayer] = {}
        if self.format in _NAMES:
            self._check_linears(_NAMES[self.format])
        elif self.format == "gpt-oss-mxfp4":
            self._check_gpt_oss()
        else:
            self._check_unquantized()
        if self.format != "gpt-oss-mxfp4":
            self._check_experts()

    # ------------------------------------------------------------------------------------------
    # what the checkpoint is

    @property
    def format(self) -> CheckpointFormat:
        return self.scheme.format

    @property
    def quant_algo(self) -> str | None:
        return self.scheme.quant_algo

    @property
    def exclude_patterns(self) -> tuple[str, ...]:
        return self.scheme.exclude

    @property
    def static_input_scales(self) -> bool:
        """True for W4A4 checkpoints that store calibrated activation global scales."""
        return self.scheme.static_input_scales

    def __repr__(self) -> str:
        return (f"Checkpoint({str(self.path)!r}, format={self.format!r}, quant_algo={self.quant_algo!r}, "
                f"{len(self._files.tensors)} tensors in {len(self._files.files)} file(s))")

    def tensor_names(self) -> list[str]:
        return list(self._files.tensors)

    def info(self, name: str) -> TensorInfo:
        """Dtype, shape and file of tensor ``name`` from the headers (nothing is read)."""
        try:
            return self._files.tensors[name]
        except KeyError:
            raise CheckpointError(self._unknown("tensor", name, self._files.tensors)) from None

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as stored (for the unquantized ones: embeddings, norms, routers, ...)."""
        self.info(name)
        return self._files.read(name)

    def is_excluded(self, name: str) -> bool:
        """Whether module (or tensor) ``name`` matches the checkpoint's exclude_modules / ignore /
        modules_to_not_convert patterns (or sits below a module that does)."""
        return match_exclude(self.scheme.exclude, name) is not None

    def modules(self) -> Iterator[ModuleEntry]:
        """Every module with its tensors, in natural order (layer 2 before layer 10)."""
        packed = {layer.packed for layer in self._moe.values() if layer.packed}
        for name, tensors in self._modules.items():
            kind = "nvfp4_linear" if name in self._linears else "mxfp4_experts" if name in packed else "tensors"
            yield ModuleEntry(name, kind, dict(tensors), self.is_excluded(name))

    def linear_names(self) -> list[str]:
        """Modules stored as quantized linears (ModelOpt / compressed-tensors), experts included."""
        return list(self._linears)

    def moe_layers(self) -> list[str]:
        """Prefixes of the MoE layers (e.g. ``model.layers.1.mlp``) that :meth:`experts` reads."""
        return [p for p, layer in self._moe.items() if layer.quantized]

    def linear_shape(self, name: str) -> tuple[int, int]:
        """[N, K] of the quantized linear module ``name``, from the headers (nothing is read)."""
        spec = self._linears.get(name)
        if spec is None:
            raise CheckpointError(self._not_quantized(name))
        return spec.n, spec.k

    def expert_shape(self, layer_prefix: str) -> tuple[int, int, int]:
        """(E, I, H) of the quantized MoE layer at ``layer_prefix``, from the headers (nothing is read)."""
        prefix = layer_prefix.removesuffix(".").removesuffix(".experts")
        layer = self._moe.get(prefix)
        if layer is None or not layer.quantized:
            self.experts(prefix)  # raises the message that says why
        return layer.n_experts, layer.intermediate, layer.hidden

    # ------------------------------------------------------------------------------------------
    # reading

    def linear(self, name: str) -> LinearWeights:
        """One quantized linear (``name``: the module, or its weight tensor)."""
        module = name
        names = _NAMES.get(self.format)
        suffix = name.rsplit(".", 1)[-1]
        if name not in self._linears and names and suffix in ("weight", names.weight, *names.quant_only):
            module = module_of(name)  # a tensor name: "M.weight" (also where the format stores "M.weight_packed")
        spec = self._linears.get(module)
        if spec is None:
            raise CheckpointError(self._not_quantized(module))
        return self._read_linear(spec)

    def experts(self, layer_prefix: str, experts: Sequence[int] | None = None) -> ExpertWeights:
        """The routed experts of the MoE layer at ``layer_prefix`` (``model.layers.1.mlp``, with or
        without ``.experts``), stacked: ``w13`` [E, 2I, H], ``w2`` [E, H, I]; ``experts``: only those
        (global ids, in the order given), and only their tensors (or rows) are read."""
        prefix = layer_prefix.removesuffix(".").removesuffix(".experts")
        layer = self._moe.get(prefix)
        if layer is None:
            raise CheckpointError(self._unknown("MoE layer", prefix, self._moe))
        ids = list(range(layer.n_experts)) if experts is None else [int(e) for e in experts]
        bad = [e for e in ids if not 0 <= e < layer.n_experts]
        if bad or not ids or len(set(ids)) != len(ids):
            raise ValueError(f"experts: expected distinct ids in [0, {layer.n_experts}) ({prefix!r} has "
                             f"{layer.n_experts} experts), got {list(experts)[:8]}")
        if not layer.quantized:
            why = f" (excluded by {match_exclude(self.scheme.exclude, prefix)!r})" if self.is_excluded(prefix) else ""
            raise CheckpointError(f"{self.path}: the experts of {prefix!r} are stored unquantized{why}; "
                                  f"this {self.format} checkpoint has no FP4 experts there")
        if layer.packed:
            return self._read_gpt_oss(layer, ids)
        gates, ups, downs = zip(*[tuple(self._read_linear(self._linears[m]) for m in layer.experts[e]) for e in ids])
        w13 = stack_experts([(g.weight, u.weight) for g, u in zip(gates, ups)])
        w2 = stack_experts([(d.weight,) for d in downs])
        w13_bias = self._stack_bias([(g.bias, u.bias) for g, u in zip(gates, ups)], prefix, "gate/up")
        w2_bias = self._stack_bias([(d.bias,) for d in downs], prefix, "down")
        w13_in = w2_in = None
        if all(x.input_global_scale is not None for x in (*gates, *ups, *downs)):
            w13_in = torch.stack([torch.maximum(g.input_global_scale, u.input_global_scale)
                                  for g, u in zip(gates, ups)])
            w2_in = torch.stack([d.input_global_scale for d in downs])
        return ExpertWeights(w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias, layout="gate_up",
                             w13_input_scale=w13_in, w2_input_scale=w2_in)

    def close(self) -> None:
        self._files.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------
    # header checks (on open)

    def _check_linears(self, names: _LinearNames) -> None:
        for module, params in self._modules.items():
            weight = params.get(names.weight)
            packed = weight is not None and weight.dtype == "U8"
            if names is COMPRESSED_TENSORS and weight is not None and weight.dtype != "U8":
                raise CheckpointError(f"{_where(weight)}: expected U8 packed NVFP4 codes [N, K/2], found "
                                      f"{weight.describe()}")
            if packed:
                self._linears[module] = self._check_linear(module, params, names)
                continue
            orphans = [s for s in names.quant_only if s in params]
            if orphans:
                info = params[orphans[0]]
                if weight is None:
                    raise CheckpointError(f"{_where(info)}: {names.label} scale without its weight: missing tensor "
                                          f"{module + '.' + names.weight!r}")
                raise CheckpointError(f"{_where(weight)}: expected U8 packed NVFP4 codes [N, K/2] (the module has "
                                      f"{orphans[0]!r}), found {weight.describe()}")

    def _check_linear(self, module: str, params: Mapping[str, TensorInfo], names: _LinearNames) -> _LinearSpec:
        weight = params[names.weight]
        if len(weight.shape) != 2:
            raise CheckpointError(f"{_where(weight)}: expected a 2-D U8[N, K/2] packed weight, found "
                                  f"{weight.describe()}")
        n, k = weight.shape[0], weight.shape[1] * 2
        if k % NVFP4.block_size:
            raise CheckpointError(f"{_where(weight)}: K = 2 x {weight.shape[1]} = {k} is not a multiple of the "
                                  f"NVFP4 block size {NVFP4.block_size}")
        required = [names.scale, names.global_] + ([names.input] if self.static_input_scales else [])
        for suffix in required:
            if suffix not in params:
                algo = f" ({self.quant_algo}: activation scales are stored)" if suffix == names.input else ""
                raise CheckpointError(f"{weight.file}: missing tensor {module + '.' + suffix!r}{algo}; {names.label} "
                                      f"stores {', '.join(required)} next to {names.weight!r}")
        allowed = {names.weight, names.scale, names.global_, names.input, *names.optional}
        extra = [s for s in params if s not in allowed]
        if extra:
            info = params[extra[0]]
            raise CheckpointError(f"{_where(info)}: extra tensor in the {names.label} linear {module!r}, which "
                                  f"stores {', '.join(sorted(allowed))}")
        _expect(params[names.scale], ("F8_E4M3",), (n, k // NVFP4.block_size), f" (block scales of [{n}, {k}])")
        _expect_scalar(params[names.global_], "weight global scale")
        if names.input in params:
            _expect_scalar(params[names.input], "activation global scale")
        if "bias" in params:
            _expect(params["bias"], FLOAT_DTYPES, (n,))
        if "weight_shape" in params:
            _expect(params["weight_shape"], ("I64", "I32"), (2,))
        for kv in ("k_scale", "v_scale"):
            if kv in params:
                _expect_scalar(params[kv], "KV-cache scale")
        return _LinearSpec(module, n, k, dict(params))

    def _check_unquantized(self) -> None:
        for module, params in self._modules.items():
            for suffix, info in params.items():
                if suffix in QUANTIZED_SUFFIXES:
                    raise CheckpointError(f"{_where(info)} looks quantized, but {self.scheme.source}: add the "
                                          "quantization config (hf_quant_config.json or quantization_config) "
                                          "that describes it")

    def _check_gpt_oss(self) -> None:
        for module, params in self._modules.items():
            if not any(s.endswith(("_blocks", "_scales")) for s in params):
                continue
            first = next(iter(params.values()))
            if not module.endswith(".experts"):
                raise CheckpointError(f"{_where(first)}: MXFP4 blocks outside an experts module; gpt-oss stores "
                                      "them as <layer>.mlp.experts.{gate_up,down}_proj_{blocks,scales}")
            for suffix in GPT_OSS_REQUIRED:
                if suffix not in params:
                    raise CheckpointError(f"{first.file}: missing tensor {module + '.' + suffix!r}; gpt-oss MXFP4 "
                                          f"experts store {', '.join(GPT_OSS_REQUIRED + GPT_OSS_OPTIONAL)}")
            extra = [s for s in params if s not in GPT_OSS_REQUIRED + GPT_OSS_OPTIONAL]
            if extra:
                raise CheckpointError(f"{_where(params[extra[0]])}: extra tensor in the gpt-oss MXFP4 experts "
                                      f"{module!r}, which store {', '.join(GPT_OSS_REQUIRED + GPT_OSS_OPTIONAL)}")
            gb = params["gate_up_proj_blocks"]
            if gb.dtype != "U8" or len(gb.shape) != 4 or gb.shape[3] != 16 or gb.shape[1] % 2:
                raise CheckpointError(f"{_where(gb)}: expected U8[E, 2I, H/32, 16], found {gb.describe()}")
            e, two_i, h_blocks, _ = gb.shape
            h, i = h_blocks * MXFP4.block_size, two_i // 2
            if i % MXFP4.block_size:
                raise CheckpointError(f"{_where(gb)}: intermediate size I = {i} is not a multiple of the MXFP4 block "
                                      f"size {MXFP4.block_size}, so down_proj cannot be blocked")
            _expect(params["gate_up_proj_scales"], ("U8",), (e, two_i, h_blocks), " (E8M0 exponents)")
            _expect(params["down_proj_blocks"], ("U8",), (e, h, i // MXFP4.block_size, 16))
            _expect(params["down_proj_scales"], ("U8",), (e, h, i // MXFP4.block_size), " (E8M0 exponents)")
            if "gate_up_proj_bias" in params:
                _expect(params["gate_up_proj_bias"], FLOAT_DTYPES, (e, two_i))
            if "down_proj_bias" in params:
                _expect(params["down_proj_bias"], FLOAT_DTYPES, (e, h))
            prefix = module.removesuffix(".experts")
            self._moe[prefix] = _MoELayer(prefix, e, h, i, quantized=True, packed=module)

    def _check_experts(self) -> None:
        layers: dict[str, dict[int, dict[str, str]]] = {}
        for module in self._modules:
            m = _EXPERT.match(module)
            if m:
                roles = layers.setdefault(m["prefix"], {}).setdefault(int(m["index"]), {})
                roles[_ROLE[m["proj"]]] = module
        for prefix, experts in layers.items():
            indices = sorted(experts)
            if indices != list(range(len(indices))):
                missing = sorted(set(range(indices[-1] + 1)) - set(indices))
                raise CheckpointError(f"{self.path}: {prefix}.experts: expert {missing[0]} is missing (found "
                                      f"{len(indices)} experts numbered up to {indices[-1]})")
            rows = []
            shapes: dict[str, tuple[int, int]] = {}
            quantized = set()
            for index in indices:
                roles = experts[index]
                for role in ("gate", "up", "down"):
                    if role not in roles:
                        style = "w1/w3/w2" if any(r.rsplit(".", 1)[-1].startswith("w") for r in roles.values()) \
                            else f"{role}_proj"
                        raise CheckpointError(f"{self.path}: {prefix}.experts.{index}: missing the {role} projection "
                                              f"({style}); every expert needs gate, up and down")
                    mod = roles[role]
                    shape, info = self._linear_shape(mod)
                    quantized.add(mod in self._linears)
                    want = shapes.setdefault(role, shape)
                    if shape != want:
                        raise CheckpointError(f"{_where(info)}: expected the shape of expert 0's {role} projection "
                                              f"[N, K] = {list(want)}, found {list(shape)}")
                rows.append((roles["gate"], roles["up"], roles["down"]))
            if len(quantized) > 1:
                raise CheckpointError(f"{self.path}: {prefix}.experts: some experts are stored quantized and some "
                                      f"unquantized; fp4moe needs all of a layer's experts in one format")
            (i, h), (i2, h2), (h3, i3) = shapes["gate"], shapes["up"], shapes["down"]
            if (i, h) != (i2, h2) or (h3, i3) != (h, i):
                raise CheckpointError(f"{self.path}: {prefix}.experts: gate {list(shapes['gate'])}, up "
                                      f"{list(shapes['up'])} and down {list(shapes['down'])} do not fit "
                                      "gate/up [I, H] and down [H, I]")
            self._moe[prefix] = _MoELayer(prefix, len(indices), h, i, quantized=quantized == {True},
                                          experts=tuple(rows))

    def _linear_shape(self, module: str) -> tuple[tuple[int, int], TensorInfo]:
        spec = self._linears.get(module)
        if spec is not None:
            return (spec.n, spec.k), next(iter(spec.tensors.values()))
        weight = self._modules[module].get("weight")
        if weight is None:
            first = next(iter(self._modules[module].values()))
            raise CheckpointError(f"{first.file}: missing tensor {module + '.weight'!r} (a 2-D expert weight)")
        if len(weight.shape) != 2:
            raise CheckpointError(f"{_where(weight)}: expected a 2-D expert weight [N, K], found "
                                  f"{weight.dtype}{list(weight.shape)}")
        return (weight.shape[0], weight.shape[1]), weight

    # ------------------------------------------------------------------------------------------
    # tensor reads

    def _read(self, info: TensorInfo) -> torch.Tensor:
        return self._files.read(info.name)

    def _read_linear(self, spec: _LinearSpec) -> LinearWeights:
        names = _NAMES[self.format]
        t = spec.tensors
        data = self._read(t[names.weight])
        scales = self._read(t[names.scale])
        _check_e4m3_scales(scales, t[names.scale])
        raw_global = self._read(t[names.global_])
        inverted = names is COMPRESSED_TENSORS
        convert = invert_stored_global if inverted else check_global
        gs = convert(raw_global, _where(t[names.global_]))
        input_gs = None
        if names.input in t:
            input_gs = convert(self._read(t[names.input]), _where(t[names.input]))
        bias = self._read(t["bias"]) if "bias" in t else None
        if "weight_shape" in t:
            stored = [int(v) for v in self._read(t["weight_shape"])]
            if stored != [spec.n, spec.k]:
                raise CheckpointError(f"{_where(t['weight_shape'])}: says [{', '.join(map(str, stored))}] but "
                                      f"{names.weight!r} holds [{spec.n}, {spec.k}]")
        weight = FP4Tensor(data=data, scales=scales, global_scale=gs, shape=torch.Size((spec.n, spec.k)), fmt=NVFP4)
        return LinearWeights(weight=weight, bias=bias, input_global_scale=input_gs)

    def _read_rows(self, info: TensorInfo, ids: list[int]) -> torch.Tensor:
        """The rows ``ids`` of a tensor stacked per expert, read run by contiguous run."""
        if ids == list(range(info.shape[0])):
            return self._read(info)
        runs, start = [], 0
        for j in range(1, len(ids) + 1):
            if j == len(ids) or ids[j] != ids[j - 1] + 1:
                runs.append(self._files.read(info.name, slice(ids[start], ids[j - 1] + 1)))
                start = j
        return torch.cat(runs) if len(runs) > 1 else runs[0]

    def _read_gpt_oss(self, layer: _MoELayer, ids: list[int]) -> ExpertWeights:
        t = self._modules[layer.packed]
        e, h, i = len(ids), layer.hidden, layer.intermediate
        out = []
        for proj, n, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            blocks = self._read_rows(t[f"{proj}_blocks"], ids)
            scales = self._read_rows(t[f"{proj}_scales"], ids)
            nan = int((scales == 255).sum())
            if nan:
                raise CheckpointError(f"{_where(t[f'{proj}_scales'])}: {nan} E8M0 scale(s) are 255 (NaN): corrupted")
            out.append(make_fp4(blocks.reshape(e, n, k // 2), scales, None, (e, n, k), MXFP4))
        bias = [self._read_rows(t[b], ids) if b in t else None for b in GPT_OSS_OPTIONAL]
        return ExpertWeights(w13=out[0], w2=out[1], w13_bias=bias[0], w2_bias=bias[1], layout="interleaved")

    def _stack_bias(self, per_expert: list[tuple[torch.Tensor | None, ...]], prefix: str, what: str):
        present = {b is not None for parts in per_expert for b in parts}
        if present == {False}:
            return None
        if present != {True}:
            raise CheckpointError(f"{self.path}: {prefix}.experts: some {what} projections have a bias and some do "
                                  "not; expected all or none")
        return torch.stack([torch.cat(parts) for parts in per_expert])

    # ------------------------------------------------------------------------------------------
    # messages

    def _unknown(self, what: str, name: str, known) -> str:
        close = difflib.get_close_matches(name, list(known), n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        return f"{self.path}: no {what} named {name!r} in this {self.format} checkpoint{hint}"

    def _not_quantized(self, module: str) -> str:
        if module not in self._modules:
            return self._unknown("quantized linear", module, self._linears)
        weight = self._modules[module].get("weight")
        stored = f" ({weight.describe()})" if weight is not None else ""
        pattern = match_exclude(self.scheme.exclude, module)
        why = f", excluded by {pattern!r}" if pattern is not None else ""
        return f"{self.path}: {module!r} is stored unquantized{stored}{why}; read it with tensor()"


def _check_e4m3_scales(scales: torch.Tensor, info: TensorInfo) -> None:
    bits = scales.view(torch.uint8)
    nan_codes = e4m3_is_nan(bits)
    nan = int(nan_codes.sum())
    negative = int((invalid_scale_codes(bits, "e4m3") & ~nan_codes).sum())
    if nan or negative:
        raise CheckpointError(f"{_where(info)}: {nan} NaN and {negative} negative E4M3 block scale(s): corrupted")


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open the model folder ``path`` (any format fp4moe reads); see :class:`Checkpoint`."""
    return Checkpoint(path)
