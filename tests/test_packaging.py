"""Dependencies are declared where they are used: every third-party module fleetd/ and agent/
import is a runtime dependency (or an optional extra whose code imports it lazily), and every one
tests/ imports is a runtime or test dependency, not something that happens to arrive with moto."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OWN = {"fleetd", "agent", "tests", "bench"}
# Declared for what they do at run time, though nothing here imports them by name.
INDIRECT = {"numpy": "torch.distributed.checkpoint needs it as soon as more than one rank saves"}


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def _imports(folder: Path) -> set[str]:
    found: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in OWN}


def _dists(modules: set[str]) -> dict[str, set[str]]:
    by_module = metadata.packages_distributions()
    return {m: {d.lower().replace("_", "-") for d in by_module.get(m, [])} for m in modules}


def test_runtime_imports_are_runtime_dependencies() -> None:
    runtime = _names(PROJECT["dependencies"])
    extras = set().union(*(_names(v) for k, v in PROJECT["optional-dependencies"].items() if k != "test"))
    missing = {
        m: d
        for m, d in _dists(_imports(ROOT / "fleetd") | _imports(ROOT / "agent")).items()
        if not d & (runtime | extras)
    }
    assert not missing, f"imported by fleetd/ or agent/ but not declared: {missing}"


def test_test_imports_are_declared_for_the_tests() -> None:
    declared = _names(PROJECT["dependencies"]) | set().union(
        *(_names(v) for v in PROJECT["optional-dependencies"].values())
    )
    missing = {m: d for m, d in _dists(_imports(ROOT / "tests")).items() if not d & declared}
    assert not missing, f"imported by tests/ but not declared: {missing}"


def test_no_runtime_dependency_goes_unused() -> None:
    used = set().union(*_dists(_imports(ROOT / "fleetd") | _imports(ROOT / "agent")).values())
    # Imported by a dependency's own name differing from ours: nvidia-ml-py is `pynvml`.
    unused = _names(PROJECT["dependencies"]) - used - set(INDIRECT)
    assert not unused, f"declared runtime dependencies nothing in fleetd/ or agent/ imports: {unused}"
