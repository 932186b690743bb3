"""safetensors without pickle: validated headers, sharded folders, lazy reads and a streaming writer.

A safetensors file is ``u64 little-endian header length N``, ``N`` bytes of JSON
(``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets": [begin, end]}}``), then the
data section; offsets are relative to it, tensors are contiguous, without holes or overlap, and
the last one ends at the end of the file. :func:`read_header` checks all of that itself so that a
truncated or corrupted file gives an error naming the file and the tensor, before any tensor is
read. Tensors are then read one at a time through ``safetensors.safe_open``.

:class:`ShardWriter` writes one file whose header is known in advance (the writer plans every
output tensor from the source headers), accepting tensors in any order: memory holds one tensor
group at a time however large the shard.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError

__all__ = [
    "DTYPES",
    "dtype_name",
    "TensorInfo",
    "TensorSpec",
    "read_header",
    "ShardSet",
    "ShardWriter",
    "INDEX_NAME",
    "SINGLE_NAME",
    "natural_key",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: safetensors refuses headers above 100 MB; so do we (a corrupted length is usually huge).
MAX_HEADER_BYTES = 100_000_000
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

#: safetensors dtype names and the torch dtypes they hold.
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
_NAMES = {v: k for k, v in DTYPES.items()}
_ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}
FLOAT_DTYPES = ("F16", "BF16", "F32")


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ("BF16" for torch.bfloat16)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} has no safetensors name") from None


def natural_key(name: str) -> tuple:
    """Sort key that puts ``layers.2`` before ``layers.10``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's name, safetensors dtype name and shape: what a header says about it."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _ITEMSIZE[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def describe(self) -> str:
        """``BF16[64, 128]``: how error messages print a tensor's type."""
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class TensorInfo(TensorSpec):
    """A tensor found in a file's header."""

    file: Path = Path()


def _fail(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}")


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate the header of a safetensors file without reading any tensor.

    Returns (tensors by name, the ``__metadata__`` strings). Raises :class:`CheckpointError`
    naming the file (and the tensor) for: a file shorter than 8 bytes, a header length beyond
    the file size, a header that is not JSON or not a JSON object, an unknown dtype, a bad
    shape or offsets, a tensor whose byte span does not match its dtype and shape, holes or
    overlaps between tensors, data that ends before the last tensor (truncated) or after it.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _fail(path, f"file is {size} bytes, too short for a safetensors header (8-byte length + JSON)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise _fail(path, f"header length {n:,} bytes is above the {MAX_HEADER_BYTES:,}-byte limit "
                                  f"(file size {size:,}): not a safetensors file, or corrupted")
            if 8 + n > size:
                raise _fail(path, f"header length {n:,} bytes runs past the end of the file ({size:,} bytes): "
                                  "truncated or not a safetensors file")
            raw = f.read(n)
    except FileNotFoundError:
        raise _fail(path, "no such file") from None
    except IsADirectoryError:
        raise _fail(path, "is a directory, expected a safetensors file") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _fail(path, f"header ({n:,} bytes) is not valid JSON ({err}): corrupted") from None
    if not isinstance(header, dict):
        raise _fail(path, f"header is JSON {type(header).__name__}, expected an object of tensors")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise _fail(path, f"__metadata__ is {type(metadata).__name__}, expected an object of strings")
    data_size = size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise _fail(path, f"tensor {name!r}: header entry is {type(entry).__name__}, expected an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPES:
            raise _fail(path, f"tensor {name!r}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise _fail(path, f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise _fail(path, f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
        info = TensorInfo(name=name, dtype=dtype, shape=tuple(shape), file=path)
        if offsets[1] - offsets[0] != info.nbytes:
            raise _fail(path, f"tensor {name!r}: {info.describe()} needs {info.nbytes:,} bytes but data_offsets "
                              f"{offsets} span {offsets[1] - offsets[0]:,}: corrupted header")
        tensors[name] = info
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            what = "overlaps the previous tensor" if begin < end else f"leaves a hole of {begin - end:,} bytes"
            raise _fail(path, f"tensor {name!r}: data_offsets begin at {begin:,} where the previous tensor ends "
                              f"at {end:,}; it {what}: corrupted header")
        end = stop
    if end > data_size:
        last = spans[-1][2]
        raise _fail(path, f"truncated: tensor {last!r} ends at byte {end:,} of the data section, but the file "
                          f"holds only {data_size:,} data bytes ({size:,} bytes in all)")
    if end < data_size:
        raise _fail(path, f"{data_size - end:,} bytes follow the last tensor: corrupted (the header accounts for "
                          f"{end:,} data bytes, the file has {data_size:,})")
    return tensors, {str(k): str(v) for k, v in metadata.items()}


class ShardSet:
    """The safetensors files of a model folder: one ``model.safetensors``, or the shards that
    ``model.safetensors.index.json`` names. Every header is read and checked on construction:
    the index and the headers must agree tensor for tensor (nothing missing, nothing extra)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / INDEX_NAME
        if index.exists():
            self.index_path: Path | None = index
            self.tensors = self._from_index(index)
        else:
            self.index_path = None
            self.tensors = self._from_single()
        self.files = sorted({t.file for t in self.tensors.values()}, key=lambda p: natural_key(p.name))
        self._handles: dict[Path, object] = {}

    def _from_single(self) -> dict[str, TensorInfo]:
        single = self.folder / SINGLE_NAME
        if not single.exists():
            found = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if len(found) == 1:
                single = self.folder / found[0]
            elif found:
                raise CheckpointError(f"{self.folder}: {len(found)} safetensors files ({', '.join(found[:4])}"
                                      f"{', ...' if len(found) > 4 else ''}) but no {INDEX_NAME} to say which "
                                      "tensor is where")
            else:
                pickles = sorted(p.name for p in self.folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
                hint = (f"; found only pickle weights ({', '.join(pickles[:3])}), which fp4moe never loads: "
                        "convert them to safetensors first") if pickles else ""
                raise CheckpointError(f"{self.folder}: no {SINGLE_NAME} and no {INDEX_NAME}{hint}")
        tensors, _ = read_header(single)
        return tensors

    def _from_index(self, index: Path) -> dict[str, TensorInfo]:
        try:
            doc = json.loads(index.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{index}: not valid JSON ({err})") from None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            bad = next((f"{k!r}: {v!r}" for k, v in weight_map.items() if not isinstance(v, str)), None) \
                if isinstance(weight_map, dict) else None
            found = (f"the entry {bad} (shard names are strings)" if bad else
                     type(weight_map).__name__ if isinstance(doc, dict) else type(doc).__name__)
            raise CheckpointError(f"{index}: expected an object with \"weight_map\": {{tensor: shard file}}, "
                                  f"found {found}")
        if not weight_map:
            raise CheckpointError(f"{index}: its weight_map lists no tensor")
        root = self.folder.resolve()
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        tensors: dict[str, TensorInfo] = {}
        for shard, names in sorted(by_shard.items()):
            path = self.folder / shard
            if root not in path.resolve().parents:
                raise CheckpointError(f"{index}: shard {shard!r} is outside the model folder {self.folder}")
            if not path.exists():
                raise CheckpointError(f"{index}: shard {shard!r} (holding {len(names)} tensors, e.g. {names[0]!r}) "
                                      f"does not exist in {self.folder}")
            found, _ = read_header(path)
            missing = sorted(set(names) - set(found), key=natural_key)
            if missing:
                raise CheckpointError(f"{path}: missing tensor {missing[0]!r} (the index puts {len(missing)} "
                                      f"tensor(s) in this shard that its header lacks)")
            extra = sorted(set(found) - set(names), key=natural_key)
            if extra:
                raise CheckpointError(f"{path}: extra tensor {extra[0]!r} ({len(extra)} tensor(s) in this shard "
                                      f"are not in {INDEX_NAME}, or the index puts them elsewhere)")
            tensors.update(found)
        return tensors

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Load one tensor (a copy; the file stays mapped, not loaded), or only its ``rows`` (a slice of
        its first axis: what is read from the file is those rows)."""
        from safetensors import safe_open

        info = self.tensors[name]
        handle = self._handles.get(info.file)
        if handle is None:
            try:
                handle = safe_open(str(info.file), framework="pt", device="cpu")
            except Exception as err:  # safetensors raises its own error types
                raise CheckpointError(f"{info.file}: safetensors cannot open it ({err})") from None
            self._handles[info.file] = handle
        shape = info.shape
        if rows is not None:
            start, stop, step = rows.indices(info.shape[0] if info.shape else 0)
            if step != 1 or not info.shape:
                raise ValueError(f"rows: expected a contiguous slice of the first axis of {name!r}, got {rows}")
            shape = (max(0, stop - start), *info.shape[1:])
        try:
            tensor = handle.get_tensor(name) if rows is None else handle.get_slice(name)[start:stop]
        except Exception as err:
            raise CheckpointError(f"{info.file}: tensor {name!r} cannot be read ({err})") from None
        if tensor.dtype != info.torch_dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(f"{info.file}: tensor {name!r} read as {tensor.dtype}{list(tensor.shape)}, "
                                  f"header says {info.describe()}")
        return tensor

    def close(self) -> None:
        self._handles.clear()  # safe_open handles unmap when collected


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


class ShardWriter:
    """Write one safetensors file whose tensors are all known before the first byte of data.

    The layout follows safetensors' own (tensors sorted by decreasing item size, then by name,
    so each is aligned to its item size; the header padded with spaces to 8 bytes). Tensors
    may then arrive in any order; each is checked against its spec and written at its offset.
    ``close()`` fails if one was never written.
    """

    def __init__(self, path: str | Path, specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None):
        if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
            raise CheckpointError("safetensors data is little-endian; this machine is not")
        self.path = Path(path)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise CheckpointError(f"{self.path}: tensor {dup!r} planned twice")
        ordered = sorted(specs, key=lambda s: (-_ITEMSIZE[s.dtype], s.name))
        header: dict[str, object] = {"__metadata__": dict(metadata or {})}
        self._offsets: dict[str, tuple[int, TensorSpec]] = {}
        offset = 0
        for spec in ordered:
            header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            self._offsets[spec.name] = (offset, spec)
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self._data_start = 8 + len(raw)
        self.nbytes = self._data_start + offset
        self._pending = set(self._offsets)
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._file.truncate(self.nbytes)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._offsets:
            raise CheckpointError(f"{self.path}: tensor {name!r} was not planned for this shard")
        if name not in self._pending:
            raise CheckpointError(f"{self.path}: tensor {name!r} written twice")
        offset, spec = self._offsets[name]
        if tensor.dtype != spec.torch_dtype or tuple(tensor.shape) != spec.shape:
            raise CheckpointError(f"{self.path}: tensor {name!r} is {dtype_name(tensor.dtype)}{list(tensor.shape)}, "
                                  f"planned as {spec.describe()}")
        self._file.seek(self._data_start + offset)
        self._file.write(_tensor_bytes(tensor))
        self._pending.discard(name)

    def close(self) -> None:
        self._file.close()
        if self._pending:
            first = sorted(self._pending, key=natural_key)[0]
            raise CheckpointError(f"{self.path}: {len(self._pending)} planned tensor(s) never written, e.g. {first!r}")

    def abort(self) -> None:
        self._file.close()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: Path, *, what: str) -> dict:
    """Read a JSON object; errors name the file."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file ({what})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: expected a JSON object ({what}), found {type(doc).__name__}")
    return doc


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (after renames) where the OS allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)

