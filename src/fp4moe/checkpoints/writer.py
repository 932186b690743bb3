"""``write_checkpoint``: a bf16 Hugging Face model to an NVFP4 checkpoint (ModelOpt or compressed-tensors).

The writer plans every output tensor from the source headers first (names, dtypes, shapes,
shards), then streams: one source tensor is read, quantized and written at its planned offset
before the next is read, so memory holds one tensor group however large the model. Everything
goes to a temporary folder next to ``out_dir`` that is checked (re-opened as a checkpoint) and
then renamed into place: ``out_dir`` is never half-written. Every file and the folder are flushed
to disk (fsync) before the rename, and the parent folder after it.

Every checkpoint carries a marker file, ``fp4moe_checkpoint.json`` (the fp4moe version and the
format); ``overwrite=True`` replaces only a folder holding one, never another model or an arbitrary
folder. A run holds a lock file ``.<out>.lock`` next to ``out_dir`` (the writer's pid, created
exclusively) from its last check of ``out_dir`` to the rename, so a second run into the same folder
fails at once instead of racing the first; a lock whose pid is no longer alive is taken over.
Temporary (``.<out>.tmp-<pid>-*``) and replaced (``.<out>.old-<pid>-*``) folders left by a run that
was killed are removed by the next run into ``out_dir``.

Which tensors are quantized is :func:`fp4moe.checkpoints.policy.quantize_decision`; each becomes
``fp4moe.quantize(w, "nvfp4", global_scale=checkpoint_global_scale(amax(w)))`` (the ModelOpt
global ``amax/2688``, nudged by one ulp for the 17% of values whose fp32 reciprocal does not
round-trip, so that both formats read back to the same FP4Tensor bit for bit). No activation
scales are written (there is no calibration): the checkpoints are weight-only NVFP4, labelled
``W4A16_NVFP4`` (ModelOpt) and ``input_activations: null`` (compressed-tensors), which W4A4
kernels run with dynamic activation global scales.

Fused experts (transformers v5: ``experts.gate_up_proj`` / ``down_proj``, 3-D, optional biases)
are split into one linear per expert and projection, as ModelOpt and compressed-tensors store
experts (``fp4moe.checkpoints.fused``); each slice is quantized like any other linear, so the
result equals, bit for bit, the checkpoint of the same model saved with per-expert weights.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from ..quantize import quantize
from .errors import CheckpointError
from .fused import FUSED_NAMES, FusedLayout, check_fused, fused_layout, split_fused
from .policy import BLOCK_K, match_exclude, module_of, quantize_decision
from .reader import Checkpoint
from .safetensors_io import (
    INDEX_NAME,
    PICKLE_SUFFIXES,
    SINGLE_NAME,
    ShardWriter,
    TensorInfo,
    TensorSpec,
    fsync_dir,
    natural_key,
    write_json,
)
from .scales import checkpoint_global_scale
from .schemes import CT_FORMAT, HF_QUANT_CONFIG

__all__ = ["write_checkpoint", "WriteReport", "WriteFormat", "WRITE_FORMATS", "DEFAULT_MAX_SHARD_BYTES",
           "MARKER_NAME", "parse_size"]

WriteFormat = Literal["modelopt", "compressed-tensors"]
WRITE_FORMATS: tuple[str, ...] = ("modelopt", "compressed-tensors")
#: Hugging Face's default shard size ("5GB").
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
MODELOPT_ALGO = "W4A16_NVFP4"
#: The file that marks a folder as a checkpoint written by fp4moe (the only kind ``overwrite`` replaces).
MARKER_NAME = "fp4moe_checkpoint.json"
_SKIP_FILES = {"config.json", INDEX_NAME, HF_QUANT_CONFIG, MARKER_NAME}
#: A lock file that is still empty this long after it was created is left over from a killed run.
_EMPTY_LOCK_STALE_S = 60.0


@dataclass(frozen=True)
class WriteReport:
    """What :func:`write_checkpoint` wrote."""

    out_dir: Path
    format: WriteFormat
    quantized: tuple[str, ...]  # modules written as NVFP4 linears
    kept: dict[str, str] = field(default_factory=dict)  # unquantized 2-D weights -> why
    shards: tuple[str, ...] = ()
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass(frozen=True)
class _Group:
    """One source tensor and the output tensors it becomes: three when quantized, itself when
    copied; for fused experts (``fused`` set) three per expert and projection, or one bias each."""

    source: TensorInfo
    outputs: tuple[TensorSpec, ...]
    quantized: bool
    fused: FusedLayout | None = None

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)


def parse_size(text: str | int) -> int:
    """'5GB' -> 5_000_000_000, '512MiB' -> 536_870_912, '1000' -> 1000 (bytes)."""
    if isinstance(text, int):
        value = text
    else:
        units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                 "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
        s = text.strip().upper().replace(" ", "")
        number = s.rstrip("KMGTIB")
        unit = s[len(number):]
        try:
            value = int(float(number) * units[unit])
        except (ValueError, KeyError):
            raise ValueError(f"size: expected a number of bytes with an optional unit (e.g. 5GB, 500MB, 2GiB), "
                             f"got {text!r}") from None
    if value <= 0:
        raise ValueError(f"size: expected a positive number of bytes, got {text!r}")
    return value


def _quantized_outputs(module: str, n: int, k: int, fmt: WriteFormat) -> tuple[TensorSpec, ...]:
    if fmt == "modelopt":
        return (TensorSpec(f"{module}.weight", "U8", (n, k // 2)),
                TensorSpec(f"{module}.weight_scale", "F8_E4M3", (n, k // 16)),
                TensorSpec(f"{module}.weight_scale_2", "F32", ()))
    return (TensorSpec(f"{module}.weight_packed", "U8", (n, k // 2)),
            TensorSpec(f"{module}.weight_scale", "F8_E4M3", (n, k // 16)),
            TensorSpec(f"{module}.weight_global_scale", "F32", (1,)))


_FUSED_ROLES = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",),
                "gate_up_proj_bias": ("gate_proj", "up_proj"), "down_proj_bias": ("down_proj",)}


def _fused_modules(src: Checkpoint) -> dict[str, dict[str, TensorInfo]]:
    """``<layer>.experts`` modules holding transformers-v5 fused expert tensors (suffix -> header)."""
    fused: dict[str, dict[str, TensorInfo]] = {}
    for name in src.tensor_names():
        info = src.info(name)
        module, leaf = module_of(name), name.rsplit(".", 1)[-1]
        if module.endswith(".experts") and leaf in FUSED_NAMES and info.dtype in ("BF16", "F16", "F32"):
            fused.setdefault(module, {})[leaf] = info
        elif len(info.shape) == 3 and module.endswith(".experts") and info.dtype in ("BF16", "F16", "F32"):
            raise CheckpointError(f"{info.file}: tensor {name!r} {info.describe()} holds fused experts under a name "
                                  f"the writer does not know; it reads {', '.join(FUSED_NAMES)} (transformers v5) "
                                  "or per-expert Linear weights (experts.<e>.gate_proj.weight, up_proj, down_proj)")
    return fused


def _fused_groups(module: str, tensors: dict[str, TensorInfo], layout: FusedLayout, fmt: WriteFormat,
                  model_type: str | None) -> list[_Group]:
    """The per-expert linears a fused experts module becomes (see ``fp4moe.checkpoints.fused``)."""
    e, i, h = check_fused(module, tensors, layout, model_type)
    groups = []
    for suffix in FUSED_NAMES:
        info = tensors.get(suffix)
        if info is None:
            continue
        roles = _FUSED_ROLES[suffix]
        if suffix.endswith("_bias"):
            n = i if suffix.startswith("gate_up") else h
            outputs = tuple(TensorSpec(f"{module}.{x}.{role}.bias", info.dtype, (n,)) for x in range(e) for role in roles)
        else:
            n, k = (i, h) if suffix == "gate_up_proj" else (h, i)
            outputs = tuple(o for x in range(e) for role in roles
                            for o in _quantized_outputs(f"{module}.{x}.{role}", n, k, fmt))
        groups.append(_Group(info, outputs, not suffix.endswith("_bias"), fused=layout))
    return groups


def _plan(src: Checkpoint, fmt: WriteFormat, exclude: Sequence[str]) -> tuple[list[_Group], dict[str, str]]:
    groups, kept = [], {}
    model_type = src.config.get("model_type")
    fused = _fused_modules(src)
    planned_fused: set[str] = set()
    for name in sorted(src.tensor_names(), key=natural_key):
        info = src.info(name)
        module = module_of(name)
        if module in fused:
            pattern = match_exclude(exclude, module)
            tensors = fused[module]
            _, i, h = check_fused(module, tensors, fused_layout(model_type), model_type)
            why = (f"excluded by {pattern!r}" if pattern is not None else
                   f"K={h if i % BLOCK_K == 0 else i} is not a multiple of {BLOCK_K}" if h % BLOCK_K or i % BLOCK_K
                   else None)
            if why is None:
                if module not in planned_fused:
                    planned_fused.add(module)
                    groups += _fused_groups(module, tensors, fused_layout(model_type), fmt, model_type)
                continue
            kept[module] = why  # both projections stay fused and unquantized
            groups.append(_Group(info, (TensorSpec(info.name, info.dtype, info.shape),), False))
            continue
        decision = quantize_decision(name, info.dtype, info.shape, exclude)
        if decision.quantize:
            n, k = info.shape
            groups.append(_Group(info, _quantized_outputs(module, n, k, fmt), True))
        else:
            groups.append(_Group(info, (TensorSpec(info.name, info.dtype, info.shape),), False))
            if name.endswith(".weight") and len(info.shape) == 2:
                kept[module] = decision.reason
    return groups, kept


def _expert_block(module: str) -> str | None:
    """'model.layers.0.mlp.experts' for any module of that block's routed experts, else None."""
    head, sep, _ = module.partition(".experts.")
    return head + ".experts" if sep else None


def _check_experts_agree(model_dir: Path, groups: list[_Group], kept: dict[str, str]) -> None:
    """Refuse, before writing anything, a block whose experts would be written partly quantized
    (readers refuse such a block; found only after the write, it cost the whole run)."""
    quantized = {_expert_block(module_of(g.source.name)) for g in groups if g.quantized}
    for module, why in kept.items():
        block = _expert_block(module)
        if block is not None and block in quantized:
            raise CheckpointError(f"{model_dir}: {module} would stay unquantized ({why}) while other experts of "
                                  f"{block} are quantized; an MoE block's experts must share one format (store "
                                  f"them all as bf16/fp16/fp32, or exclude the whole block: --exclude '{block}')")


def _shard(groups: list[_Group], max_bytes: int) -> list[list[_Group]]:
    """Greedy: a group never straddles shards; a group above ``max_bytes`` gets a shard of its own."""
    shards: list[list[_Group]] = [[]]
    size = 0
    for g in groups:
        if shards[-1] and size + g.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(g)
        size += g.nbytes
    return shards


def _quantization_configs(fmt: WriteFormat, exclude: Sequence[str], kept: dict[str, str]) -> tuple[dict, dict | None]:
    """(config.json quantization_config, hf_quant_config.json or None)."""
    from .. import __version__

    explicit = sorted(kept, key=natural_key)
    if fmt == "modelopt":
        ignore = list(dict.fromkeys([*exclude, *explicit]))
        producer = {"name": "fp4moe", "version": __version__}
        return ({"quant_method": "modelopt", "quant_algo": MODELOPT_ALGO, "group_size": 16, "ignore": ignore,
                 "kv_cache_scheme": None, "producer": producer},
                {"producer": producer, "quantization": {"quant_algo": MODELOPT_ALGO, "kv_cache_quant_algo": None,
                                                        "group_size": 16, "exclude_modules": ignore}})
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
               "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
               "observer_kwargs": {}}
    return ({"quant_method": "compressed-tensors", "format": CT_FORMAT, "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                           "output_activations": None, "format": CT_FORMAT}},
             "ignore": explicit, "kv_cache_scheme": None, "global_compression_ratio": None}, None)


def _write_fp4(tensor: torch.Tensor, specs: Sequence[TensorSpec], writer: ShardWriter, fmt: WriteFormat,
              where: str) -> None:
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        raise CheckpointError(f"{where} has {int((~finite).sum())} NaN/Inf value(s); refusing to quantize it")
    gs = checkpoint_global_scale(tensor.abs().amax().to(torch.float32))
    q = quantize(tensor, "nvfp4", global_scale=gs)
    data_spec, scale_spec, global_spec = specs
    writer.write(data_spec.name, q.data)
    writer.write(scale_spec.name, q.scales)
    stored = gs if fmt == "modelopt" else torch.ones_like(gs) / gs  # compressed-tensors: inverted
    writer.write(global_spec.name, stored.reshape(global_spec.shape))


def _write_group(src: Checkpoint, group: _Group, writer: ShardWriter, fmt: WriteFormat) -> None:
    tensor = src.tensor(group.source.name)
    where = f"{group.source.file}: tensor {group.source.name!r}"
    if group.fused is not None:
        suffix = group.source.name.rsplit(".", 1)[-1]
        parts = [p for per_expert in split_fused(suffix, tensor, group.fused) for p in per_expert]
        if not group.quantized:
            for spec, part in zip(group.outputs, parts, strict=True):
                writer.write(spec.name, part)
            return
        for index, part in enumerate(parts):
            expert, role = divmod(index, len(_FUSED_ROLES[suffix]))
            _write_fp4(part, group.outputs[3 * index:3 * index + 3], writer, fmt,
                       f"{where} (expert {expert}, {_FUSED_ROLES[suffix][role]})")
        return
    if not group.quantized:
        writer.write(group.source.name, tensor)
        return
    _write_fp4(tensor, group.outputs, writer, fmt, where)


def _is_fp4moe_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds the marker file that fp4moe writes into every checkpoint."""
    try:
        marker = json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("producer") == "fp4moe"


def _check_out_dir(model_dir: Path, out_dir: Path, overwrite: bool) -> None:
    src, out = model_dir.resolve(), out_dir.resolve()
    if out == src:
        raise CheckpointError(f"{out_dir}: is the source model folder; write to another folder")
    if out in src.parents:  # replacing it would delete the model being read
        raise CheckpointError(f"{out_dir}: contains the source model folder {model_dir}; write to another folder")
    if out_dir.exists():
        if not out_dir.is_dir():
            raise CheckpointError(f"{out_dir}: exists and is not a folder")
        if any(out_dir.iterdir()):
            if not overwrite:
                raise CheckpointError(f"{out_dir}: exists and is not empty; pass overwrite=True (--overwrite) to "
                                      "replace it")
            if not (out_dir / "config.json").is_file():  # replace checkpoints only, never an arbitrary folder
                raise CheckpointError(f"{out_dir}: is not empty and holds no config.json (not a checkpoint): "
                                      "overwrite replaces checkpoint folders only; empty it or choose another")
            if not _is_fp4moe_checkpoint(out_dir):  # another model, or a project folder: never deleted
                raise CheckpointError(f"{out_dir}: holds a config.json but no {MARKER_NAME}, so it is not a "
                                      "checkpoint written by fp4moe: overwrite replaces only folders fp4moe wrote; "
                                      "if it is no longer needed, remove it yourself, or choose another folder")


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    except OSError:  # pragma: no cover - e.g. a platform without signals: assume alive
        return True
    return True


def _lock_path(out_dir: Path) -> Path:
    return out_dir.with_name(f".{out_dir.name}.lock")


def _acquire_lock(out_dir: Path) -> Path:
    """Create ``.<out>.lock`` next to ``out_dir`` exclusively, holding this process's pid.

    A lock held by a live process fails at once; one whose pid is no longer alive (or that stayed
    empty for a minute: its writer died between creating and filling it) is taken over.
    """
    lock = _lock_path(out_dir)
    for _ in range(5):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                text = lock.read_text()
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:  # released meanwhile: try again
                continue
            try:
                pid = int(text.strip())
            except ValueError:
                pid = None
            if pid is None and age < _EMPTY_LOCK_STALE_S or pid is not None and _pid_alive(pid):
                holder = f"process {pid}" if pid is not None else "a process that is starting"
                raise CheckpointError(f"{out_dir}: another fp4moe write into this folder is running ({holder} holds "
                                      f"the lock {lock}); wait for it to finish, or, if no such run is going on, "
                                      "remove the lock file") from None
            try:  # stale: take it over, unless another writer took it over first
                if lock.read_text() == text:
                    lock.unlink()
            except FileNotFoundError:
                pass
            continue
        try:
            os.write(fd, f"{os.getpid()}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return lock
    raise CheckpointError(f"{out_dir}: could not take the lock {lock} (other writers keep taking it); "
                          "try again")  # pragma: no cover - a race of several writers


def _release_lock(lock: Path) -> None:
    try:
        if lock.read_text().strip() == str(os.getpid()):
            lock.unlink()
    except OSError:  # pragma: no cover - already gone
        pass


def _leftovers(out_dir: Path) -> list[tuple[str, Path]]:
    """(kind, path) of ``.<out>.tmp-<pid>-*`` and ``.<out>.old-<pid>-*`` folders whose pid is not alive."""
    pattern = re.compile(rf"^\.{re.escape(out_dir.name)}\.(tmp|old)-(\d+)-")
    found = []
    for path in out_dir.parent.iterdir():
        m = pattern.match(path.name)
        if m and path.is_dir() and not path.is_symlink() and not _pid_alive(int(m.group(2))):
            found.append((m.group(1), path))
    return found


def _clean_leftovers(out_dir: Path) -> None:
    """Remove what killed runs into ``out_dir`` left behind (call with the lock held).

    A run killed between moving the old checkpoint aside and renaming the new one into place
    leaves no ``out_dir`` and a ``.old-`` folder holding the previous checkpoint: that one is
    renamed back to ``out_dir`` rather than deleted.
    """
    leftovers = _leftovers(out_dir)
    if not out_dir.exists():
        olds = sorted((p for kind, p in leftovers if kind == "old"), key=lambda p: p.stat().st_mtime)
        if olds:
            os.replace(olds[-1], out_dir)
            leftovers = [(kind, p) for kind, p in leftovers if p != olds[-1]]
    for _, path in leftovers:
        shutil.rmtree(path, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    """Flush every file in ``folder`` and then the folder itself to disk."""
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            except OSError as err:  # pragma: no cover - a file system without fsync
                if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
                    raise
            finally:
                os.close(fd)
    fsync_dir(folder)


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    _fsync_tree(tmp)  # the data is on disk before the rename publishes it
    if out_dir.exists() and any(out_dir.iterdir()):
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.replace(out_dir, old)
        try:
            os.replace(tmp, out_dir)
        except BaseException:
            os.replace(old, out_dir)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    fsync_dir(out_dir.parent)


def write_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    format: WriteFormat = "modelopt",
    exclude: Sequence[str] | None = (),
    *,
    overwrite: bool = False,
    progress: bool = True,
    max_shard_bytes: int | str = DEFAULT_MAX_SHARD_BYTES,
    on_group: Callable[[str], None] | None = None,
) -> WriteReport:
    """Quantize the bf16 Hugging Face model in ``model_dir`` to an NVFP4 checkpoint in ``out_dir``.

    Args:
        model_dir: a folder with ``config.json`` and safetensors (one file or sharded + index).
        out_dir: where the checkpoint goes; it must not exist or be empty unless ``overwrite``.
        format: "modelopt" (``weight``/``weight_scale``/``weight_scale_2``, ``hf_quant_config.json``)
            or "compressed-tensors" (``weight_packed``/``weight_scale``/``weight_global_scale``,
            globals inverted).
        exclude: module name patterns to keep unquantized (fnmatch wildcards or ``re:<regex>``);
            each must match at least one module (a typo would silently quantize what it meant to keep).
        overwrite: replace a non-empty ``out_dir`` (only once the new checkpoint is complete); only a
            checkpoint fp4moe wrote (one holding ``fp4moe_checkpoint.json``) is replaced, any other
            folder is refused.
        progress: show a progress bar (rich, on stderr).
        max_shard_bytes: shard size bound, bytes or a string such as "5GB".
        on_group: called with each source tensor's name after it is written (tests, logging).

    Returns:
        A :class:`WriteReport`. Raises :class:`CheckpointError` for bad input; ``out_dir`` is then
        untouched and no temporary folder is left behind.
    """
    if format not in WRITE_FORMATS:
        raise CheckpointError(f"format: expected one of {', '.join(WRITE_FORMATS)}, got {format!r}")
    exclude = [] if exclude is None else [exclude] if isinstance(exclude, str) else list(exclude)
    try:
        max_bytes = parse_size(max_shard_bytes)
    except ValueError as err:
        raise CheckpointError(f"max_shard_bytes: {err}") from None
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    _check_out_dir(model_dir, out_dir, overwrite)
    out_dir = out_dir.resolve()  # "." or "x/..": the temporary and old folders are named after it
    for pattern in exclude:
        if isinstance(pattern, str) and pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as err:
                raise CheckpointError(f"exclude pattern {pattern!r}: not a valid regular expression ({err})") from None

    with Checkpoint(model_dir) as src:
        if src.format != "bf16":
            raise CheckpointError(f"{model_dir}: is already a {src.format} checkpoint ({src.quant_algo}); "
                                  "fp4moe quantize reads an unquantized (bf16/fp16/fp32) model")
        modules = {module_of(n) for n in src.tensor_names()}
        for pattern in exclude:
            if not any(match_exclude([pattern], m) for m in modules):
                raise CheckpointError(f"exclude pattern {pattern!r} matches no module of {model_dir} "
                                      "(fnmatch wildcards over module names, e.g. 'model.layers.*.self_attn*')")
        groups, kept = _plan(src, format, exclude)
        _check_experts_agree(model_dir, groups, kept)
        if not any(g.quantized for g in groups):
            reasons = sorted(set(kept.values())) or ["no 2-D weights"]
            raise CheckpointError(f"{model_dir}: no tensor to quantize (2-D Linear projection weights whose K is a "
                                  f"multiple of 16); kept: {', '.join(reasons)}")
        shards = _shard(groups, max_bytes)
        names = ([SINGLE_NAME] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        lock = _acquire_lock(out_dir)  # from the last check of out_dir to the rename, one writer at a time
        try:
            _clean_leftovers(out_dir)
            _check_out_dir(model_dir, out_dir, overwrite)  # again, under the lock
            tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-{os.getpid()}-", dir=out_dir.parent))
            try:
                bytes_out = _write_shards(src, shards, names, tmp, format, progress, on_group)
                _write_configs(src, model_dir, tmp, format, exclude, kept, shards, names)
                with Checkpoint(tmp) as check:  # headers, index and config agree before anyone sees them
                    if check.format != format:  # pragma: no cover - a writer bug
                        raise CheckpointError(f"{tmp}: wrote a {check.format} checkpoint, meant {format}")
                _move_into_place(tmp, out_dir)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            _release_lock(lock)
    return WriteReport(out_dir=out_dir, format=format,
                       quantized=tuple(module_of(o.name) for g in groups if g.quantized for o in g.outputs[::3]),
                       kept=kept,
                       shards=tuple(names), bytes_in=sum(g.source.nbytes for g in groups), bytes_out=bytes_out)


def _write_shards(src: Checkpoint, shards: list[list[_Group]], names: list[str], tmp: Path, fmt: WriteFormat,
                  progress: bool, on_group: Callable[[str], None] | None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    total = sum(g.source.nbytes for shard in shards for g in shard)
    columns = (TextColumn("[bold]{task.description:<40}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    written = 0
    with Progress(*columns, console=Console(stderr=True), disable=not progress) as bar:
        task = bar.add_task(f"quantizing to {fmt}", total=total)
        for index, (shard, name) in enumerate(zip(shards, names)):
            specs = [o for g in shard for o in g.outputs]
            with ShardWriter(tmp / name, specs, {"format": "pt"}) as writer:
                for group in shard:
                    label = module_of(group.source.name)
                    bar.update(task, description=f"{index + 1}/{len(shards)} {label[-34:]}")
                    _write_group(src, group, writer, fmt)
                    bar.update(task, advance=group.source.nbytes)
                    if on_group is not None:
                        on_group(group.source.name)
            written += writer.nbytes
    return written


def _write_configs(src: Checkpoint, model_dir: Path, tmp: Path, fmt: WriteFormat, exclude: Sequence[str],
                   kept: dict[str, str], shards: list[list[_Group]], names: list[str]) -> None:
    if len(shards) > 1:
        weight_map = {o.name: name for shard, name in zip(shards, names) for g in shard for o in g.outputs}
        total = sum(g.nbytes for shard in shards for g in shard)
        write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    quant_config, hf_quant = _quantization_configs(fmt, exclude, kept)
    write_json(tmp / "config.json", {**src.config, "quantization_config": quant_config})
    if hf_quant is not None:
        write_json(tmp / HF_QUANT_CONFIG, hf_quant)
    from .. import __version__

    write_json(tmp / MARKER_NAME, {"producer": "fp4moe", "version": __version__, "format": fmt})
    for path in sorted(model_dir.iterdir()):
        if (path.is_file() and not path.name.startswith(".") and path.name not in _SKIP_FILES
                and path.suffix != ".safetensors" and path.suffix not in PICKLE_SUFFIXES):
            shutil.copy2(path, tmp / path.name)
