"""The package's layout is its architecture (README "Layout"): checked on the source, without importing it.

Walks every module of ``hfzero/`` with ``ast`` (imports inside functions and ``TYPE_CHECKING`` blocks included:
a deferred import is still a dependency) and fails on an import circle, on the engine (runtime/) importing the
layers built on it (parallel/, integrations/, profiler/), on the communication layer importing anything above it,
and on a lower layer importing the package root (``import hfzero`` runs the public entry points). The one import
not counted is the root's own ``TYPE_CHECKING`` block, which names its lazy exports for type checkers.
"""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hfzero"

ROOT_MODULES = {"__init__", "__main__", "config", "devices", "logging", "roles", "version"}
"""What the package root may hold: the public entry points and the leaves every layer uses."""

FORBIDDEN = {
    "hfzero.runtime": ("hfzero.parallel", "hfzero.integrations", "hfzero.profiler", "hfzero.planning",
                       "hfzero.checkpoint", "hfzero.loading", "hfzero.cli", "hfzero.testing"),
    "hfzero.comm": ("hfzero.runtime", "hfzero.parallel", "hfzero.integrations", "hfzero.profiler",
                    "hfzero.planning", "hfzero.checkpoint", "hfzero.loading", "hfzero.cli", "hfzero.testing"),
}
"""Layer -> the layers above it that it must not import (ARCHITECTURE: each depends only on those below)."""

MAY_IMPORT_ROOT = ("hfzero.integrations", "hfzero.testing", "hfzero.cli")
"""The top layers, which may use ``import hfzero``; every other module takes names from their own modules."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST, skip_type_checking: bool):
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and skip_type_checking and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported hfzero module: line}, from the source."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in _import_nodes(ast.parse(path.read_text()), skip_type_checking=name == "hfzero"):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            for target in targets:
                if not target.startswith("hfzero"):
                    continue
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != name:
                    edges.setdefault(resolved, node.lineno)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle() -> None:
    graph = import_graph()
    circles = _cycles(graph)
    detail = ["; ".join(f"{a} -> {b} (line {graph[a][b]})" for a in circle for b in graph[a] if b in circle)
              for circle in circles]
    assert not circles, detail


def test_cycle_finder_finds_a_circle() -> None:
    """The check above can fail: a made-up graph with a circle through three modules is reported."""
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b": 1}, "b": {}}) == []


def test_layers_import_only_downwards() -> None:
    bad = [f"{module} imports {target} (line {line})" for module, edges in import_graph().items()
           for layer, above in FORBIDDEN.items() if module == layer or module.startswith(layer + ".")
           for target, line in edges.items() if target.startswith(above)]
    assert not bad, bad


def test_lower_layers_never_import_the_package_root() -> None:
    bad = [f"{module} (line {edges['hfzero']})" for module, edges in import_graph().items()
           if "hfzero" in edges and module != "hfzero" and not module.startswith(MAY_IMPORT_ROOT)]
    assert not bad, bad


def test_runtime_never_names_the_wrappers() -> None:
    """Not even in a message or a docstring: the engine takes groups and knows no wrapper (issue 31)."""
    hits = [f"{path.relative_to(PACKAGE.parent)}:{number}" for path in (PACKAGE / "runtime").rglob("*.py")
            for number, line in enumerate(path.read_text().splitlines(), 1) if "hfzero.parallel" in line]
    assert not hits, hits


def test_the_root_holds_only_entry_points_and_leaves() -> None:
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    assert modules == ROOT_MODULES, sorted(modules ^ ROOT_MODULES)


def test_public_names_import_as_before() -> None:
    import hfzero

    for name in hfzero.__all__:
        assert getattr(hfzero, name) is not None, name
    from hfzero.comm import CommStats, Communicator, Handle  # the old module's names, from the package now

    assert Communicator.__module__ == "hfzero.comm.collectives" and CommStats and Handle


@pytest.mark.parametrize("old", sorted(__import__("hfzero").MOVED))
def test_moved_modules_keep_working_with_a_warning(old: str) -> None:
    import hfzero

    new = importlib.import_module(hfzero.MOVED[old])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import sys

        sys.modules.pop(old, None)
        module = importlib.import_module(old)
    assert module is new
    assert any(issubclass(w.category, DeprecationWarning) and hfzero.MOVED[old] in str(w.message) for w in caught)
