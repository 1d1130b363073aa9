"""Layering (docs/DESIGN.md): policy is pure; the agent uses only fleetd.protocol from fleetd; the
agent's rooms import only downward; no module in agent/ or fleetd/ imports one that imports it back.

Checked statically over every module's imports (including imports inside functions and under
TYPE_CHECKING), so a lazy import cannot sneak I/O into the policy layer or close a circle.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.import_graph import ROOT, build_graph, cycles, imported_names, layer_violations, room_of
IO_MODULES = ("asyncio", "boto3", "botocore", "aiobotocore", "aiomqtt", "paho", "torch", "aiohttp",
              "sqlite3", "socket", "subprocess", "requests", "urllib", "httpx", "time", "threading")
# The agent's rooms (docs/DESIGN.md, "The agent's rooms"), top layer first. A module may import its
# own room and the rooms of lower layers; rooms of one layer are independent of each other.
AGENT_LAYERS = [
    ["agent.cli", "agent.doubles", "agent.examples"],  # entry point; test/demo doubles; examples
    ["agent.main"],  # the composition: which hooks, which context
    ["agent.supervise"],  # torchrun, warm pool, the notice flow, the hooks for a training node
    ["agent.hooks"],  # the interface between the agent and what it drives
    ["agent.node"],  # senses and voice: IMDS, telemetry, MQTT session, outbox, trainer channel
    ["agent.trainer"],  # the in-process library a training script imports
    ["agent.checkpoint_store"],  # S3 checkpoint store
    ["agent.config", "agent"],  # settings and the version
]
# fleetd.protocol is the only part of fleetd the agent sees; fleetd.protocol itself must stay free
# of controller code (policy/reconcile/adapters/...), or the rule would be hollow.
CONTROLLER_PARTS = ("fleetd.policy", "fleetd.reconcile", "fleetd.adapters", "fleetd.sim",
                    "fleetd.intake", "fleetd.rendezvous", "fleetd.commands", "fleetd.daemon",
                    "fleetd.cli", "fleetd.config", "fleetd.metrics", "fleetd.ha")


def _imports(path: Path) -> set[str]:
    return imported_names(path)


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


def test_agent_rooms_import_only_downward() -> None:
    bad = layer_violations(build_graph(["agent"]), AGENT_LAYERS)
    assert not bad, "the agent's rooms must import only downward:\n" + "\n".join(bad)


def test_every_agent_module_lives_in_a_room() -> None:
    # A loose module under agent/ would fall into the bottom layer unnoticed: name its room instead.
    loose = [m for m in build_graph(["agent"]) if m != "agent" and room_of(m, AGENT_LAYERS)[1] == "agent"]
    assert not loose, f"put these in a room (and in AGENT_LAYERS): {loose}"


def test_no_module_imports_one_that_imports_it_back() -> None:
    found = cycles(build_graph(["agent", "fleetd"]))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_an_upward_import_or_a_circle_fails(tmp_path: Path) -> None:
    # The checks above pass on today's tree; prove they would fail on a deliberately broken copy.
    shutil.copytree(ROOT / "agent", tmp_path / "agent", ignore=shutil.ignore_patterns("__pycache__"))
    imds = tmp_path / "agent" / "node" / "imds.py"
    imds.write_text(imds.read_text() + "\nfrom agent.supervise.torchrun import TorchrunProcess  # upward\n")
    graph = build_graph(["agent"], tmp_path)
    assert any(v.startswith("agent.node.imds -> agent.supervise.torchrun: imports upward")
               for v in layer_violations(graph, AGENT_LAYERS))
    channel = tmp_path / "agent" / "node" / "trainer_channel.py"
    channel.write_text(channel.read_text() + "\ndef _late():\n    from agent.node.telemetry import TelemetryLoop\n")
    assert ["agent.node.telemetry", "agent.node.trainer_channel"] in cycles(build_graph(["agent"], tmp_path))
