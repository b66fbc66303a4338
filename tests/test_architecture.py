"""The import contract: storage <- planners <- dcpbridge; inside dcpbridge model <- formats <-
engine <- tools, with mcore/ and dist_checkpointing/ on top; and no import cycle.

Imports are read from the source with ``ast`` (nothing is imported), so the test states what
the code says. The layering and the cycle check hold for every import: module level, inside
functions (which Python runs late, but a reader still follows) and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# source folder -> the package it installs as
PACKAGES = {
    "dcpbridge": "dcpbridge",
    "planners": "dcpbridge.planners",
    "storage": "dcpbridge.storage",
}
UPPER = ("model", "formats", "engine", "tools", "mcore", "dist_checkpointing")
# dcpbridge's own layers, bottom up: a module may import its own layer and the ones below
LAYERS = {
    "dcpbridge.errors": 0,
    "dcpbridge.model": 1,
    "dcpbridge.formats": 2,
    "dcpbridge.engine": 3,
    "dcpbridge.tools": 4,
    "dcpbridge.mcore": 5,
    "dcpbridge.dist_checkpointing": 6,
    "dcpbridge.demo": 7,
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a package's __init__ when a name is imported from it)
    at_import: bool  # runs when ``source`` is imported (module level, not TYPE_CHECKING)
    line: int


def _module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [PACKAGES[folder], *rest]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache  # the tree does not change during a run: read and parsed once
def _modules() -> dict[str, Path]:
    return {
        _module_name(p): p for folder in PACKAGES for p in sorted((ROOT / folder).rglob("*.py"))
    }


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, at_import: bool) -> Iterator[tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or (
            isinstance(child, ast.If) and _is_type_checking(child)
        ):
            yield from _walk(child, False)
        else:
            yield child, at_import
            yield from _walk(child, at_import)


def _imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[Import]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node, at_import in _walk(ast.parse(path.read_text(), str(path)), True):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(name, alias.name, at_import, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield Import(name, sub if sub in modules else base, at_import, node.lineno)


@functools.cache
def _all_imports() -> tuple[Import, ...]:
    modules = _modules()
    return tuple(i for name, path in modules.items() for i in _imports(name, path, modules))


def _ours(target: str) -> bool:
    return target == "dcpbridge" or target.startswith("dcpbridge.")


def _within(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def test_storage_imports_nothing_else_of_ours():
    bad = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in _all_imports()
        if _within(i.source, "dcpbridge.storage")
        and _ours(i.target)
        and not _within(i.target, "dcpbridge.storage")
    ]
    assert not bad, bad


def test_planners_import_only_planners_and_storage():
    bad = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in _all_imports()
        if _within(i.source, "dcpbridge.planners")
        and _ours(i.target)
        and not (_within(i.target, "dcpbridge.planners") or _within(i.target, "dcpbridge.storage"))
    ]
    assert not bad, bad


def test_lower_layers_never_name_the_upper_ones():
    upper = [f"dcpbridge.{p}" for p in UPPER]
    bad = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in _all_imports()
        if (_within(i.source, "dcpbridge.planners") or _within(i.source, "dcpbridge.storage"))
        and any(_within(i.target, u) for u in upper)
    ]
    assert not bad, bad


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or a self-import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


# storage's sub-packages, bottom up: the format is pure, byte movers use it, both sides use both
STORAGE_LAYERS = {
    "dcpbridge.storage.errors": 0,
    "dcpbridge.storage.format": 1,
    "dcpbridge.storage.backends": 2,
    "dcpbridge.storage.write": 3,
    "dcpbridge.storage.read": 3,
}


def test_storage_sub_packages_import_only_downwards():
    """format <- backends <- {write, read}; the two sides never import each other."""
    bad = []
    for i in _all_imports():
        src = next((r for p, r in STORAGE_LAYERS.items() if _within(i.source, p)), None)
        dst = next((r for p, r in STORAGE_LAYERS.items() if _within(i.target, p)), None)
        if src is None or dst is None:
            continue
        if dst > src or (dst == src and i.source.split(".")[2] != i.target.split(".")[2]):
            bad.append(f"{i.source}:{i.line} imports {i.target}")
    assert not bad, bad


def test_every_storage_module_is_in_a_sub_package():
    loose = [
        n
        for n in _modules()
        if _within(n, "dcpbridge.storage")
        and n != "dcpbridge.storage"
        and not any(_within(n, p) for p in STORAGE_LAYERS)
    ]
    assert not loose, loose


def _layer(module: str) -> int | None:
    for package, rank in LAYERS.items():
        if _within(module, package):
            return rank
    return None


def test_dcpbridge_layers_import_only_downwards():
    """model <- formats <- engine <- tools <- mcore <- dist_checkpointing (the package's
    ``__init__`` re-exports them all and sits above)."""
    bad = []
    for i in _all_imports():
        src, dst = _layer(i.source), _layer(i.target)
        if src is not None and dst is not None and dst > src:
            bad.append(f"{i.source}:{i.line} imports {i.target} (an upper layer)")
    assert not bad, bad


def test_every_dcpbridge_module_has_a_layer():
    unplaced = [
        name
        for name in _modules()
        if _within(name, "dcpbridge")
        and name != "dcpbridge"
        and not _within(name, "dcpbridge.planners")
        and not _within(name, "dcpbridge.storage")
        and _layer(name) is None
    ]
    assert not unplaced, unplaced


@pytest.mark.parametrize("at_import_only", [True, False], ids=["module-level", "all"])
def test_no_import_cycles(at_import_only):
    edges: dict[str, set[str]] = {}
    for i in _all_imports():
        if (i.at_import or not at_import_only) and _ours(i.target) and i.target != i.source:
            edges.setdefault(i.source, set()).add(i.target)
    # a package's __init__ re-exports its modules: edges into it from its own modules are
    # the ordinary "import a sibling through the package" and are cycles too
    assert _cycles(edges) == []


@pytest.mark.parametrize(
    "module",
    ["dcpbridge.engine.protocol", "dcpbridge.engine.ownership", "dcpbridge.formats.checkpoint"],
)
def test_the_answers_a_newcomer_looks_for_are_in_one_module_each(module):
    assert module in _modules()  # named in the README's "Architecture" section


def test_no_test_helpers_in_production_code():
    sources = {name: path.read_text() for name, path in _modules().items()}
    assert "dcpbridge.launch" not in sources
    assert not [n for n, text in sources.items() if "CALLS" in text or "free_port" in text]
