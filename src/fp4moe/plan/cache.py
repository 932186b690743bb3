"""Disk cache of cross-compilation results.

One JSON file per compilation, named by a SHA-256 key of

* the kernel source: the text of the kernel's module and of every ``fp4moe.kernels`` module it
  imports, transitively (the @triton.jit functions and the constexpr globals they read: an edit
  to any of them invalidates the entry);
* the request (signature, constexprs, target compute capability, warps, stages, divisibility);
* the Triton version, and ``FORMAT`` (bumped when the stored fields change).

Location: ``$FP4MOE_CACHE_DIR/plan`` if set, else ``~/.cache/fp4moe/plan``. Files are written
atomically (a temporary file renamed over the target) and a file that cannot be read is ignored
with a warning and compiled again. Failures of the compiler itself (an exception, an abort) are
cached like successes since they are as deterministic; a timeout is not.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import os
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path

from .crosscompile import CompiledKernel, CompileRequest, _from_json

__all__ = ["FORMAT", "CompileCache", "default_cache_dir", "kernel_source_hash"]

FORMAT = 3  # 3: loop_spill_ops for every kernel with spills (plan.sass), not only wgmma ones
_KERNEL_PACKAGE = "fp4moe.kernels"


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
        path = self.path(request)
        try:
            text = path.read_text()
        except FileNotFoundError:
            self.misses += 1
            return None
        except OSError as err:
            warnings.warn(f"fp4moe plan cache: cannot read {path} ({err}); compiling again", RuntimeWarning,
                          stacklevel=2)
            self.misses += 1
            return None
        try:
            record = json.loads(text)
            if record.get("format") != FORMAT:
                raise ValueError(f"format {record.get('format')!r}, expected {FORMAT}")
            result = _from_json(record["result"])
        except (ValueError, KeyError, TypeError) as err:
            warnings.warn(f"fp4moe plan cache: ignoring corrupt entry {path} ({err}); compiling again",
                          RuntimeWarning, stacklevel=2)
            self.misses += 1
            return None
        self.hits += 1
        return result

    def put(self, request: CompileRequest, result: CompiledKernel) -> None:
        if not result.ok and result.error and result.error.startswith("cross-compilation timed out"):
            return  # not a property of the program
        path = self.path(request)
        record = {"format": FORMAT, "kernel": request.kernel, "cc": request.cc, "result": asdict(result)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            os.replace(tmp, path)
        except OSError as err:
            warnings.warn(f"fp4moe plan cache: cannot write {path} ({err}); continuing without it",
                          RuntimeWarning, stacklevel=2)
