"""What the import-linter contracts in pyproject.toml (`make lint`) cannot say.

The layers themselves (policy pure, the agent seeing only fleetd.protocol and fleetd.shared,
protocol free of controller code, the agent's rooms importing downward) are import-linter
contracts. Two rules are left here: no module in agent/ or fleetd/ imports one that imports it
back (a contract sees packages, and fleetd's top-level packages are not a strict hierarchy), and
every agent module lives in a room the layers contract names (a module outside every layer is not
checked at all). Imports inside functions and under TYPE_CHECKING count.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

from tests.import_graph import ROOT, build_graph, cycles


def _agent_rooms() -> list[str]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (rooms_contract,) = [c for c in contracts if c["type"] == "layers" and c.get("containers") == ["agent"]]
    return [f"agent.{room.strip()}" for layer in rooms_contract["layers"] for room in layer.split("|")]


def test_every_agent_module_lives_in_a_room() -> None:
    rooms = _agent_rooms()
    loose = [
        m for m in build_graph(["agent"]) if m != "agent" and not any(m == r or m.startswith(r + ".") for r in rooms)
    ]
    assert not loose, f"put these in a room (pyproject.toml, the agent's layers contract): {loose}"


def test_no_module_imports_one_that_imports_it_back() -> None:
    found = cycles(build_graph(["agent", "fleetd"]))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_a_circle_fails(tmp_path: Path) -> None:
    # The check above passes on today's tree; prove it would fail on a deliberately broken copy.
    shutil.copytree(ROOT / "agent", tmp_path / "agent", ignore=shutil.ignore_patterns("__pycache__"))
    channel = tmp_path / "agent" / "node" / "trainer_channel.py"
    channel.write_text(channel.read_text() + "\ndef _late():\n    from agent.node.telemetry import TelemetryLoop\n")
    assert ["agent.node.telemetry", "agent.node.trainer_channel"] in cycles(build_graph(["agent"], tmp_path))
