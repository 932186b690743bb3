"""The layers of the house (docs: DESIGN.md, "Layers of the house"), checked on the source text.

Every module under src/fp4moe is parsed (nothing is imported); its imports, module-level and
function-local, absolute and relative, are resolved to the fp4moe modules they load. Then:

* no import cycle among fp4moe modules (a strongly connected component of more than one module);
* the layer rules below (``LAYER_RULES``): hardware-target facts (``fp4moe.target``) and formats
  sit below everything, kernels below their launchers, the runtime (``fp4moe.ops``) below the
  planner, the planner below the benchmarks and the modules;
* every fp4moe import names a module that exists;
* no file over ``MAX_LINES`` lines.

How imports are resolved: ``from P import name``, where ``P`` is a package and ``name`` is not one of
its submodules, is an edge to the module that defines ``name``: ``P/__init__`` itself, or the
submodule it re-exports ``name`` from (``from ..target import get_arch`` depends on
``fp4moe.target.resolve``). So a package's ``__init__`` loading its own parts is structure, and a
cycle through an ``__init__`` is reported only where a module really uses a name defined there.
Imports under ``if TYPE_CHECKING:`` load nothing at run time and are left out of the cycle check
(they still count for the layer rules).

Known violations that other work is removing right now are listed in ``PENDING`` (cycles, arrows)
and ``SPLITTING_NOW`` (long files); an entry that no longer occurs is reported as a warning, so
that it can be deleted and the test tightens.
"""

from __future__ import annotations

import ast
import warnings
from functools import lru_cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "fp4moe"

#: layer -> the layers it must not import (a layer is ``fp4moe.<name>`` and everything under it)
LAYER_RULES: dict[str, tuple[str, ...]] = {
    "target": ("ops", "plan", "bench", "nn", "integrations", "checkpoints", "cli"),
    "formats": ("ops", "plan", "bench", "nn", "integrations", "checkpoints", "cli"),
    "kernels": ("ops", "plan", "bench"),
    "ops": ("plan", "bench", "nn", "integrations", "cli"),
    "plan": ("bench", "nn", "integrations"),
}

MAX_LINES = 700

#: files over MAX_LINES that are being split right now (by path under src/fp4moe); empty it as they land
SPLITTING_NOW: frozenset[str] = frozenset()

#: known violations being fixed elsewhere right now: import cycles (the modules of the strongly
#: connected component) and layer arrows (importer, imported)
PENDING: frozenset = frozenset()


# ------------------------------------------------------------------------------------------------
# the import graph


@lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    """Every module under src/fp4moe by dotted name (a package by its own name, for its __init__)."""
    found = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def _in_type_checking(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return guarded


@lru_cache(maxsize=None)
def _tree(name: str) -> ast.Module:
    return ast.parse(modules()[name].read_text(), filename=str(modules()[name]))


def _absolute(importer: str, node: ast.ImportFrom) -> str:
    """The dotted module an ``ImportFrom`` names, relative imports resolved against ``importer``."""
    if not node.level:
        return node.module or ""
    package = importer if _is_package(importer) else importer.rpartition(".")[0]
    parts = package.split(".")
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@lru_cache(maxsize=None)
def _reexports(package: str) -> dict[str, str]:
    """Names a package's __init__ imports from its own submodules, and the module defining each."""
    found = {}
    for node in _tree(package).body:
        if isinstance(node, ast.ImportFrom):
            source = _absolute(package, node)
            if source.startswith(package + ".") and source in modules():
                for alias in node.names:
                    found[alias.asname or alias.name] = _defining(source, alias.name)
    return found


def _defining(module: str, name: str) -> str:
    """The fp4moe module that ``from module import name`` depends on."""
    if f"{module}.{name}" in modules():
        return f"{module}.{name}"
    if _is_package(module):
        return _reexports(module).get(name, module)
    return module


def imports(importer: str) -> list[tuple[str, int, bool]]:
    """(imported fp4moe module, line, under TYPE_CHECKING) for every import in ``importer``; a name
    that is no module keeps its dotted spelling (``test_every_import_resolves`` reports it)."""
    tree = _tree(importer)
    guarded = _in_type_checking(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    found.append((alias.name, node.lineno, id(node) in guarded))
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(importer, node)
            if source != PACKAGE and not source.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                target = _defining(source, alias.name) if source in modules() else source
                found.append((target, node.lineno, id(node) in guarded))
    return found


def _where(importer: str, line: int) -> str:
    return f"{modules()[importer].relative_to(SRC.parent)}:{line}"


def _graph(*, runtime_only: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules()}
    for importer in modules():
        for target, _, guarded in imports(importer):
            if target in modules() and target != importer and not (runtime_only and guarded):
                graph[importer].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def _describe_cycle(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    arrows = []
    for importer in sorted(component):
        for target, line, guarded in imports(importer):
            if target in component and target != importer and not guarded:
                arrows.append(f"    {importer} -> {target} ({_where(importer, line)})")
    return "cycle of " + " ⇄ ".join(sorted(component)) + ":\n" + "\n".join(dict.fromkeys(arrows))


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == PACKAGE else None


def _stale(entries, seen, what: str) -> None:
    for entry in entries:
        if entry not in seen:
            shown = " ⇄ ".join(sorted(entry)) if isinstance(entry, frozenset) else str(entry)
            warnings.warn(f"{what} entry no longer occurs, remove it: {shown}", stacklevel=2)


# ------------------------------------------------------------------------------------------------
# tests


def test_the_modules_are_found():
    names = modules()
    assert "fp4moe.target.catalogue" in names and "fp4moe.ops.routing" in names, sorted(names)
    # the resolution: a name re-exported by a package's __init__ is an edge to where it is defined
    assert _defining("fp4moe.target", "get_arch") == "fp4moe.target.resolve"
    assert _defining("fp4moe.target", "roofline") == "fp4moe.target.roofline"


def test_every_fp4moe_import_resolves():
    """An import of an fp4moe module that does not exist (a module moved, its importer not updated)."""
    bad = [f"{_where(importer, line)}: {target}" for importer in modules()
           for target, line, _ in imports(importer) if target not in modules()]
    assert not bad, "imports of fp4moe modules that do not exist:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = _graph(runtime_only=True)
    cycles = _cycles(graph)
    new = [c for c in cycles if c not in PENDING]
    _stale([p for p in PENDING if isinstance(p, frozenset)], set(cycles), "PENDING cycle")
    assert not new, "import cycles among fp4moe modules:\n" + "\n".join(_describe_cycle(c, graph) for c in new)


def test_layer_rules():
    bad = []
    seen = set()
    for importer in modules():
        forbidden = LAYER_RULES.get(_layer(importer) or "", ())
        for target, line, _ in imports(importer):
            if _layer(target) in forbidden:
                arrow = (importer, target)
                seen.add(arrow)
                if arrow not in PENDING:
                    bad.append(f"{importer} -> {target} ({_where(importer, line)}): "
                               f"{_layer(importer)} must not import {_layer(target)}")
    _stale([p for p in PENDING if isinstance(p, tuple)], seen, "PENDING arrow")
    assert not bad, "layer rules broken:\n" + "\n".join(dict.fromkeys(bad))


def test_no_file_over_the_line_limit():
    long = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long[path.relative_to(SRC / PACKAGE).as_posix()] = lines
    _stale(SPLITTING_NOW, set(long), "SPLITTING_NOW")
    bad = {path: n for path, n in long.items() if path not in SPLITTING_NOW}
    assert not bad, f"files over {MAX_LINES} lines: " + ", ".join(f"src/fp4moe/{p} ({n})" for p, n in bad.items())
