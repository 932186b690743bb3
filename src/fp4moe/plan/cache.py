"""Disk cache of cross-compilation results.

One JSON file per compilation, named by a SHA-256 key of

* the kernel source: the text of the kernel's module and of every ``fp4moe.kernels`` module it
  imports, transitively (the @triton.jit functions and the constexpr globals they read: an edit
  to any of them invalidates the entry);
* the request (signature, constexprs, target compute capability, warps, stages, divisibility);
* the Triton version, and ``FORMAT`` (bumped when the stored fields change).

Location: ``$FP4MOE_CACHE_DIR/plan`` if set, else ``~/.cache/fp4moe/plan``. Files are written
atomically (a temporary file, flushed to disk, renamed over the target). Each entry stores a
SHA-256 checksum of its content, and every entry read is checked against it and against the
fields and types the planner reads (``_validate``): an entry that cannot be read, is not UTF-8
JSON, has the wrong shape, or was edited or truncated is ignored and compiled again (and
rewritten), with one ``RuntimeWarning`` per file per process naming the file and what was wrong.
Failures of the compiler itself (an exception, an abort) are cached like successes since they are
as deterministic; a timeout is not.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import os
import tempfile
import threading
import warnings
from dataclasses import asdict
from typing import Any
from pathlib import Path

from ..target.compile_request import CompileRequest
from .crosscompile import CompiledKernel, _from_json

__all__ = ["FORMAT", "CompileCache", "default_cache_dir", "kernel_source_hash"]

#: 3: loop_spill_ops for every kernel with spills (plan.sass), not only wgmma ones;
#: 4: a checksum of the entry's content (``_checksum``)
FORMAT = 4
_KERNEL_PACKAGE = "fp4moe.kernels"

# entry files already warned about in this process: one warning per file
_warned: set[str] = set()
_warned_lock = threading.Lock()


class _BadEntry(ValueError):
    """A cache entry that must not be trusted; the message says what is wrong with it."""


#: The stored fields of ``CompiledKernel`` and the JSON types each may hold (``None`` where optional).
_RESULT_FIELDS: dict[str, tuple[str, bool]] = {  # name -> (type, optional)
    "cc": ("int", False),
    "ok": ("bool", False),
    "error": ("str", True),
    "shared": ("int", True),
    "registers": ("int", True),
    "spill_bytes": ("int", True),
    "mma": ("list[str]", False),
    "ptxas_log": ("str", False),
    "smem_buffers": ("list[str]", False),
    "compile_s": ("number", True),
    "wgmma_hazards": ("list[str]", False),
    "loop_spill_ops": ("int", True),
}


def _has_type(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "list[str]":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    raise AssertionError(kind)


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _checksum(record: dict) -> str:
    """SHA-256 of an entry's content: every field but the checksum, as canonical JSON."""
    content = {k: v for k, v in record.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _validate(record: Any, request: CompileRequest) -> dict:
    """The entry's ``result`` object once ``record`` is proven whole and of the stored shape;
    raises ``_BadEntry`` saying what is wrong otherwise."""
    if not isinstance(record, dict):
        raise _BadEntry(f"expected a JSON object, found {_json_type(record)}")
    fmt = record.get("format")
    if not _has_type(fmt, "int"):
        raise _BadEntry("no 'format' field" if "format" not in record else
                        f"'format' is {_json_type(fmt)}, expected an integer")
    if fmt != FORMAT:
        raise _BadEntry(f"format {fmt}, expected {FORMAT}")
    for name, kind in (("kernel", "str"), ("cc", "int"), ("checksum", "str")):
        if name not in record:
            raise _BadEntry(f"no {name!r} field")
        if not _has_type(record[name], kind):
            raise _BadEntry(f"{name!r} is {_json_type(record[name])}, expected {'a string' if kind == 'str' else 'an integer'}")
    result = record.get("result")
    if not isinstance(result, dict):
        raise _BadEntry("no 'result' field" if "result" not in record else
                        f"'result' is {_json_type(result)}, expected an object")
    for name, (kind, optional) in _RESULT_FIELDS.items():
        if name not in result:
            raise _BadEntry(f"no 'result.{name}' field")
        value = result[name]
        if not (value is None and optional) and not _has_type(value, kind):
            raise _BadEntry(f"'result.{name}' is {_json_type(value)}, expected {kind}{' or null' if optional else ''}")
    if record["checksum"] != _checksum(record):
        raise _BadEntry("its content does not match its checksum (edited or damaged)")
    if record["kernel"] != request.kernel or record["cc"] != request.cc or result["cc"] != request.cc:
        raise _BadEntry(f"it holds kernel {record['kernel']!r} for sm{record['cc']}, not the requested "
                        f"{request.kernel!r} for sm{request.cc}")
    return result


def _warn_once(path: Path, message: str) -> None:
    """``message`` as a RuntimeWarning, the first time ``path`` is reported in this process."""
    with _warned_lock:
        if str(path) in _warned:
            return
        _warned.add(str(path))
    warnings.warn(message, RuntimeWarning, stacklevel=3)  # the caller of CompileCache.get


def default_cache_dir() -> Path:
    """``$FP4MOE_CACHE_DIR/plan``, or ``~/.cache/fp4moe/plan``."""
    root = os.environ.get("FP4MOE_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "fp4moe"
    return base / "plan"


def _module_file(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"kernel_source_hash: cannot find the source of module {module!r}")
    return Path(spec.origin)


def _kernel_imports(module: str, tree: ast.Module, kernels_dir: Path) -> set[str]:
    """The ``fp4moe.kernels`` modules that ``module`` imports (absolute or relative imports)."""
    package = module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            candidates = [name] + [f"{name}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        for cand in candidates:
            prefix, _, leaf = cand.rpartition(".")
            if prefix == _KERNEL_PACKAGE and (kernels_dir / f"{leaf}.py").exists():
                found.add(cand)
    return found


@functools.lru_cache(maxsize=None)
def _hash_closure(module: str, mtimes: tuple[tuple[str, float], ...]) -> str:
    del mtimes  # part of the lru_cache key only: an edited file hashes again
    digest = hashlib.sha256()
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _module_file(name)
        text = path.read_text()
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
        kernels_dir = _module_file(_KERNEL_PACKAGE).parent
        todo += sorted(_kernel_imports(name, ast.parse(text), kernels_dir) - seen)
    return digest.hexdigest()


def kernel_source_hash(kernel: str) -> str:
    """SHA-256 of the source a kernel ("module:function") compiles from: its module and the
    ``fp4moe.kernels`` modules it imports, transitively. Read from the files, nothing imported."""
    module = kernel.partition(":")[0]
    package_dir = _module_file(module).parent
    mtimes = tuple(sorted((p.name, p.stat().st_mtime) for p in package_dir.glob("*.py")))
    return _hash_closure(module, mtimes)


def _triton_version() -> str:
    spec = importlib.util.find_spec("triton")
    if spec is None:
        return "none"
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")
    except PackageNotFoundError:  # pragma: no cover - a source checkout of Triton
        return "unknown"


class CompileCache:
    """Cross-compilation results on disk, keyed by kernel source, request, target and Triton."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()
        self.hits = 0
        self.misses = 0

    def key(self, request: CompileRequest) -> str:
        stamp = {
            "format": FORMAT,
            "triton": _triton_version(),
            "source": kernel_source_hash(request.kernel),
            "request": asdict(request),
        }
        return hashlib.sha256(json.dumps(stamp, sort_keys=True, default=str).encode()).hexdigest()

    def path(self, request: CompileRequest) -> Path:
        key = self.key(request)
        return self.root / key[:2] / f"{key}.json"

    def get(self, request: CompileRequest) -> CompiledKernel | None:
        """The stored result of ``request``, or None: not stored, or an entry that fails
        ``_validate`` (then one warning per file per process, and the caller compiles again)."""
        path = self.path(request)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self.misses += 1
            return None
        except OSError as err:
            _warn_once(path, f"fp4moe plan cache: cannot read {path} ({err}); compiling again")
            self.misses += 1
            return None
        try:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _BadEntry(f"not UTF-8 text: byte {err.start}") from None
            try:
                record = json.loads(text)
            except ValueError as err:
                raise _BadEntry(f"not JSON{' (empty file)' if not text.strip() else ''}: {err}") from None
            result = _from_json(_validate(record, request))
        except (_BadEntry, TypeError) as err:
            _warn_once(path, f"fp4moe plan cache: ignoring corrupt entry {path} ({err}); compiling again")
            self.misses += 1
            return None
        self.hits += 1
        return result

    def put(self, request: CompileRequest, result: CompiledKernel) -> None:
        if not result.ok and result.error and result.error.startswith("cross-compilation timed out"):
            return  # not a property of the program
        path = self.path(request)
        record: dict[str, Any] = {"format": FORMAT, "kernel": request.kernel, "cc": request.cc,
                                  "result": asdict(result)}
        record["checksum"] = _checksum(record)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())  # on disk before the rename: never a renamed, empty entry
            os.replace(tmp, path)
            tmp = None
        except OSError as err:
            warnings.warn(f"fp4moe plan cache: cannot write {path} ({err}); continuing without it",
                          RuntimeWarning, stacklevel=2)
        finally:
            if tmp is not None:  # a failed write leaves no temporary file behind
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
