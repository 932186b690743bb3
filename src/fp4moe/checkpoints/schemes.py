"""Which checkpoint format a model folder holds, read from its configuration files.

* ModelOpt: ``hf_quant_config.json`` with ``quantization.quant_algo`` "NVFP4" (W4A4: every
  quantized linear also stores ``input_scale``) or "W4A16_NVFP4" (weights only), and
  ``exclude_modules``; or ``config.json`` → ``quantization_config`` with ``quant_method``
  "modelopt", ``quant_algo`` and ``ignore``.
* compressed-tensors: ``config.json`` → ``quantization_config`` with ``quant_method``
  "compressed-tensors" and format "nvfp4-pack-quantized" (4-bit float weights, groups of 16);
  ``input_activations`` set means W4A4 (``input_global_scale`` stored), null means weights only.
* gpt-oss MXFP4: ``quant_method`` "mxfp4" (``modules_to_not_convert``).
* bf16: no quantization configuration at all.

Anything else (FP8, AWQ, int4 pack-quantized, ...) is refused with the file and the value found.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .errors import CheckpointError
from .safetensors_io import read_json

__all__ = ["CheckpointFormat", "Scheme", "detect_scheme", "HF_QUANT_CONFIG", "MODELOPT_ALGOS", "CT_FORMAT"]

CheckpointFormat = Literal["modelopt", "compressed-tensors", "gpt-oss-mxfp4", "bf16"]

HF_QUANT_CONFIG = "hf_quant_config.json"
#: ModelOpt NVFP4 algorithms fp4moe reads, and whether they store static activation scales.
MODELOPT_ALGOS: dict[str, bool] = {"NVFP4": True, "W4A16_NVFP4": False}
CT_FORMAT = "nvfp4-pack-quantized"
_SUPPORTED = ("ModelOpt quant_algo NVFP4 or W4A16_NVFP4, compressed-tensors 'nvfp4-pack-quantized', "
              "gpt-oss MXFP4 (quant_method 'mxfp4') or an unquantized model")


@dataclass(frozen=True)
class Scheme:
    """A folder's quantization scheme as its configuration states it."""

    format: CheckpointFormat
    quant_algo: str | None  # "NVFP4", "W4A16_NVFP4", "nvfp4-pack-quantized", "mxfp4" or None (bf16)
    static_input_scales: bool  # every quantized linear stores a calibrated activation global (W4A4)
    exclude: tuple[str, ...]  # exclude_modules / ignore / modules_to_not_convert, as written
    source: str  # the file and key it came from, for messages


def _patterns(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"{where}: expected a list of module name patterns, found {value!r}")
    return tuple(value)


def _group_size(value: Any, where: str) -> None:
    if value is not None and value != 16:
        raise CheckpointError(f"{where}: group_size {value!r} is not supported; NVFP4 blocks are 16 elements")


def _modelopt(q: dict, where: str, exclude_key: str) -> Scheme:
    algo = q.get("quant_algo")
    if not algo:
        raise CheckpointError(f"{where}: no quant_algo; expected one of {', '.join(MODELOPT_ALGOS)}")
    key = str(algo).upper()
    if key not in MODELOPT_ALGOS:
        raise CheckpointError(f"{where}: quant_algo {algo!r} is not supported; fp4moe reads ModelOpt "
                              f"{' or '.join(MODELOPT_ALGOS)} (supported: {_SUPPORTED})")
    _group_size(q.get("group_size"), where)
    exclude = _patterns(q.get(exclude_key, q.get("exclude_modules")), f"{where}: {exclude_key}")
    return Scheme("modelopt", key, MODELOPT_ALGOS[key], exclude, where)


def _compressed_tensors(qc: dict, where: str) -> Scheme:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}: compressed-tensors without config_groups; expected at least one group "
                              f"with format {CT_FORMAT!r}")
    static: set[bool] = set()
    for gname, group in groups.items():
        gwhere = f"{where}.config_groups.{gname}"
        if not isinstance(group, dict):
            raise CheckpointError(f"{gwhere}: expected an object, found {group!r}")
        fmt = group.get("format") or qc.get("format")
        w = group.get("weights") or {}
        act = group.get("input_activations")
        for key, v in (("weights", w), ("input_activations", act)):
            if v is not None and not isinstance(v, dict):
                raise CheckpointError(f"{gwhere}.{key}: expected an object, found {v!r}")
        found = (f"format {fmt!r}, weights num_bits {w.get('num_bits')!r} type {w.get('type')!r} "
                 f"group_size {w.get('group_size')!r}")
        if fmt != CT_FORMAT or w.get("num_bits") != 4 or w.get("type") != "float":
            raise CheckpointError(f"{gwhere}: {found} is not supported; fp4moe reads compressed-tensors "
                                  f"{CT_FORMAT!r} (4-bit float weights, groups of 16) (supported: {_SUPPORTED})")
        _group_size(w.get("group_size"), gwhere)
        if act is not None and (act.get("num_bits") != 4 or act.get("type") != "float"):
            raise CheckpointError(f"{gwhere}: input_activations num_bits {act.get('num_bits')!r} type "
                                  f"{act.get('type')!r} is not supported; expected 4-bit float (W4A4) or null (W4A16)")
        static.add(act is not None)
    if len(static) > 1:
        raise CheckpointError(f"{where}: config_groups mix W4A4 and weight-only NVFP4; fp4moe reads one or the other")
    return Scheme("compressed-tensors", CT_FORMAT, static.pop(), _patterns(qc.get("ignore"), f"{where}.ignore"), where)


def detect_scheme(folder: Path, config: dict) -> Scheme:
    """The scheme of the model folder ``folder`` whose ``config.json`` is ``config``."""
    qc = config.get("quantization_config")
    method = str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else None
    if qc is not None and not isinstance(qc, dict):
        raise CheckpointError(f"{folder / 'config.json'}: quantization_config is {type(qc).__name__}, "
                              "expected an object")
    hf_quant = folder / HF_QUANT_CONFIG
    if hf_quant.exists():
        if method is not None and not method.startswith("modelopt"):
            raise CheckpointError(f"{folder}: {HF_QUANT_CONFIG} says ModelOpt but config.json quantization_config "
                                  f"says quant_method {method!r}; which one is it?")
        doc = read_json(hf_quant, what="ModelOpt quantization config")
        q = doc.get("quantization")
        if not isinstance(q, dict):
            raise CheckpointError(f"{hf_quant}: expected a \"quantization\" object with quant_algo, found {q!r}")
        if isinstance(qc, dict):  # both files name the algorithm: they must agree (W4A4 or weight-only)
            inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
            theirs, ours = inner.get("quant_algo"), q.get("quant_algo")
            if theirs is not None and ours is not None and str(theirs).upper() != str(ours).upper():
                raise CheckpointError(f"{folder}: {HF_QUANT_CONFIG} says quant_algo {ours!r} but config.json "
                                      f"quantization_config says {theirs!r}; which one is it?")
        return _modelopt(q, f"{hf_quant}: quantization", "exclude_modules")
    if qc is None:
        return Scheme("bf16", None, False, (), f"{folder / 'config.json'} (no quantization_config)")
    where = f"{folder / 'config.json'}: quantization_config"
    if method is not None and method.startswith("modelopt"):
        q = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
        return _modelopt(q, where, "ignore" if q is qc else "exclude_modules")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method == "mxfp4":
        return Scheme("gpt-oss-mxfp4", "mxfp4", False,
                      _patterns(qc.get("modules_to_not_convert"), f"{where}.modules_to_not_convert"), where)
    raise CheckpointError(f"{where}: quant_method {qc.get('quant_method')!r} is not supported "
                          f"(supported: {_SUPPORTED})")
