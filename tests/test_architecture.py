"""The import contract: storage <- planners <- dcpbridge, and no module-level import cycles.

Imports are read from the source with ``ast`` (nothing is imported), so the test states what
the code says. Imports inside functions and under ``if TYPE_CHECKING:`` do not run when a
module is imported and are left out of the cycle check; the layering holds for all of them.
"""

from __future__ import annotations

import ast
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
UPPER = ("model", "engine", "tools", "mcore", "dist_checkpointing")


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


def _all_imports() -> list[Import]:
    modules = _modules()
    return [i for name, path in modules.items() for i in _imports(name, path, modules)]


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


def test_no_import_cycles_at_module_level():
    edges: dict[str, set[str]] = {}
    for i in _all_imports():
        if i.at_import and _ours(i.target) and i.target != i.source:
            edges.setdefault(i.source, set()).add(i.target)
    # a package's __init__ re-exports its modules: edges into it from its own modules are
    # the ordinary "import a sibling through the package" and are cycles too
    assert _cycles(edges) == []


@pytest.mark.parametrize(
    "module",
    ["dcpbridge.engine.protocol", "dcpbridge.engine.ownership", "dcpbridge.tools.formats"],
)
def test_the_answers_a_newcomer_looks_for_are_in_one_module_each(module):
    assert module in _modules()  # named in the README's "Architecture" section


def test_no_test_helpers_in_production_code():
    sources = {name: path.read_text() for name, path in _modules().items()}
    assert "dcpbridge.launch" not in sources
    assert not [n for n, text in sources.items() if "CALLS" in text or "free_port" in text]
