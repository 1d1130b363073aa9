"""The project's import graph, read statically (imports inside functions and under TYPE_CHECKING
count too): the checker behind tests/test_import_contract.py, kept apart so its rules are plain
functions over a graph that a test can also feed a deliberately broken graph."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
Graph = Mapping[str, set[str]]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(path: Path) -> set[str]:
    """Every dotted name an import statement in ``path`` mentions (``from m import x`` gives m and m.x)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def build_graph(packages: Iterable[str], root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports explicitly. ``from pkg import name`` is an edge to
    ``pkg.name`` when that is a module, else to ``pkg``. A parent package's ``__init__`` running
    first is Python's doing, not an import the module wrote, so it is not an edge."""
    files = [f for pkg in packages for f in sorted((root / pkg).rglob("*.py"))]
    modules = {module_name(f, root): f for f in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for imp in imported_names(path):
            if imp in modules:
                targets.add(imp)
            elif imp.rpartition(".")[0] in modules and imp.rpartition(".")[0] != name:
                targets.add(imp.rpartition(".")[0])
        # `from pkg import sub` also lists `pkg`: keep the package only if a name other than a
        # submodule was taken from it.
        for imp in imported_names(path):
            parent = imp.rpartition(".")[0]
            if imp in modules and parent in targets and not _takes_attribute(path, parent, modules):
                targets.discard(parent)
        targets.discard(name)
        graph[name] = targets
    return graph


def _takes_attribute(path: Path, package: str, modules: Mapping[str, Path]) -> bool:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == package and node.level == 0:
            if any(f"{package}.{a.name}" not in modules for a in node.names):
                return True
        if isinstance(node, ast.Import) and any(a.name == package for a in node.names):
            return True
    return False


def cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan): modules that import each
    other, directly or round a longer circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found
