"""Layering (DESIGN.md): policy is pure; the agent uses only fleetd.protocol from fleetd.

Checked statically over every module's imports (including imports inside functions), so a lazy
import cannot sneak I/O into the policy layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IO_MODULES = ("asyncio", "boto3", "botocore", "aiobotocore", "aiomqtt", "paho", "torch", "aiohttp",
              "sqlite3", "socket", "subprocess", "requests", "urllib", "httpx", "time", "threading")
# fleetd.protocol is the only part of fleetd the agent sees; fleetd.protocol itself must stay free
# of controller code (policy/reconcile/adapters/...), or the rule would be hollow.
CONTROLLER_PARTS = ("fleetd.policy", "fleetd.reconcile", "fleetd.adapters", "fleetd.sim",
                    "fleetd.intake", "fleetd.rendezvous", "fleetd.commands", "fleetd.daemon",
                    "fleetd.cli", "fleetd.config", "fleetd.metrics")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _files(pkg: str) -> list[Path]:
    files = sorted((ROOT / pkg).rglob("*.py"))
    assert files, f"no modules under {pkg}"
    return files


def _matches(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_policy_imports_no_io() -> None:
    bad = {
        f"{f.relative_to(ROOT)}: {name}"
        for f in _files("fleetd/policy")
        for name in _imports(f)
        if _matches(name, IO_MODULES)
    }
    assert not bad, "policy must stay pure:\n" + "\n".join(sorted(bad))


def test_agent_imports_only_protocol_from_fleetd() -> None:
    bad = {
        f"{f.relative_to(ROOT)}: {name}"
        for f in _files("agent")
        for name in _imports(f)
        if _matches(name, ("fleetd",)) and not _matches(name, ("fleetd.protocol",))
    }
    assert not bad, "the agent may import only fleetd.protocol:\n" + "\n".join(sorted(bad))


def test_protocol_imports_no_controller_code() -> None:
    bad = {
        f"{f.relative_to(ROOT)}: {name}"
        for f in _files("fleetd/protocol")
        for name in _imports(f)
        if _matches(name, CONTROLLER_PARTS) or _matches(name, ("agent",))
    }
    assert not bad, "\n".join(sorted(bad))


def test_the_checker_sees_violations(tmp_path: Path) -> None:
    # Guard against a checker that passes vacuously.
    p = tmp_path / "m.py"
    p.write_text("def f():\n    import asyncio\n    from torch import nn\n")
    assert {"asyncio", "torch", "torch.nn"} <= _imports(p)
