"""The three systemd units: `systemd-analyze verify` clean, notify+watchdog, hardening, stop bounds.

verify checks that every ExecStart binary exists and is executable, so the units (which point at the
production venv, /opt/fleetd/venv/bin) are copied with that prefix rewritten to this checkout's venv,
where `fleetd` and `fleet-agent` are installed. It needs no systemd as PID 1 (works in a container).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from agent.config import NodeConfig
from fleetd.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
UNITS = ("fleetd.service", "fleetd-rendezvous.service", "fleet-agent.service")
PROD_BIN = "/opt/fleetd/venv/bin/"
VENV_BIN = str(Path(sys.executable).parent) + "/"
INSTALL_HINT = "systemd-analyze missing: `apt-get install -y systemd` (scripts/setup.sh does it)"


def systemd_analyze() -> str:
    exe = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"
    if not Path(exe).exists():
        raise RuntimeError(INSTALL_HINT)
    return exe


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Section -> key -> values (keys such as SystemCallFilter may repeat)."""
    out: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, value = line.split("=", 1)
        out[section][key.strip()].append(value.strip())
    return out


def unit(name: str) -> dict[str, dict[str, list[str]]]:
    return parse_unit((ROOT / "systemd" / name).read_text())


def service(name: str) -> dict[str, str]:
    return {k: v[-1] for k, v in unit(name)["Service"].items()}


@pytest.fixture
def local_units(tmp_path: Path) -> list[Path]:
    paths = []
    for name in UNITS:
        text = (ROOT / "systemd" / name).read_text()
        assert PROD_BIN in text, f"{name} should run the production venv's entry point"
        path = tmp_path / name
        path.write_text(text.replace(PROD_BIN, VENV_BIN))
        paths.append(path)
    return paths


def verify(paths: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [systemd_analyze(), "verify", "--man=no", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_systemd_analyze_verify_passes_on_all_three_units(local_units):
    result = verify(local_units)
    # verify exits 0 on unknown keys and unparsable values (it only warns), so any output fails too.
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr


def test_verify_would_catch_a_typo_and_a_missing_binary(local_units, tmp_path):
    typo = tmp_path / "typo.service"
    typo.write_text(local_units[0].read_text().replace("NoNewPrivileges=", "NoNewPrivilege="))
    assert "Unknown key" in verify([typo]).stderr
    missing = tmp_path / "missing.service"
    missing.write_text(local_units[0].read_text().replace(VENV_BIN + "fleetd", "/nonexistent/fleetd"))
    assert verify([missing]).returncode != 0


@pytest.mark.parametrize(
    "name,max_exposure",
    [
        ("fleetd.service", 2.0),
        ("fleetd-rendezvous.service", 2.0),
        ("fleet-agent.service", 4.0),
    ],
)
def test_hardening_exposure_score(local_units, name, max_exposure):
    """systemd's own scoring (0 = locked down, 10 = unprotected). The agent is looser on purpose:
    torchrun and the trainer run in its sandbox and need the GPUs, JIT and NCCL syscalls."""
    path = next(p for p in local_units if p.name == name)
    result = subprocess.run(
        [systemd_analyze(), "security", "--offline=true", f"--threshold={int(max_exposure * 10)}", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    overall = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0, overall
    assert float(overall.split(":")[-1].split()[0]) <= max_exposure, overall


@pytest.mark.parametrize("name", UNITS)
def test_notify_watchdog_restart_and_dedicated_user(name):
    s = service(name)
    assert s["Type"] == "notify" and s["NotifyAccess"] == "main"
    assert 10 <= int(s["WatchdogSec"]) <= 120
    # The store must come back whatever ended it (a clean exit loses it too); the others are
    # restarted on failure only, so a stop by hand stays a stop.
    assert s["Restart"] == ("always" if name == "fleetd-rendezvous.service" else "on-failure")
    assert s["KillMode"] == "mixed"  # SIGTERM to the daemon only; it stops its children in order
    assert s["User"] not in ("root", "") and s["User"] == s["Group"]
    assert s["StateDirectory"]
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
        "RestrictSUIDSGID": "yes",
    }.items():
        assert s[key] == value, (name, key)
    assert s["ProtectHome"] in ("yes", "read-only")


def test_exec_start_runs_existing_subcommands_with_the_default_configs():
    argv = {name: shlex.split(service(name)["ExecStart"]) for name in UNITS}
    assert argv["fleetd.service"] == [PROD_BIN + "fleetd", "run", "--config", "/etc/fleetd/fleetd.toml"]
    assert argv["fleetd-rendezvous.service"][:2] == [PROD_BIN + "fleetd", "rendezvous"]
    assert argv["fleet-agent.service"] == [PROD_BIN + "fleet-agent", "run", "--config", "/etc/fleetd/agent.toml"]
    assert {"run", "rendezvous"} <= set(COMMANDS)
    help_text = subprocess.run(
        [VENV_BIN + "fleet-agent", "run", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    assert "--config" in help_text


def test_stop_timeouts_exceed_the_daemons_own_shutdown_bounds():
    import inspect

    from fleetd.daemon import run_daemon

    agent_bound = NodeConfig().shutdown_timeout_s
    assert int(service("fleet-agent.service")["TimeoutStopSec"]) >= agent_bound + 15
    fleetd_bound = inspect.signature(run_daemon).parameters["shutdown_timeout_s"].default
    assert int(service("fleetd.service")["TimeoutStopSec"]) >= fleetd_bound + 15


def test_watchdog_intervals_leave_room_for_the_daemons_own_cadence():
    from fleetd.rendezvous.host import HostSpec

    # The rendezvous host pings after each store self-check: at least two checks per WatchdogSec.
    assert int(service("fleetd-rendezvous.service")["WatchdogSec"]) >= 2 * HostSpec("h", 1).health_interval_s
    # The reconcile loop beats once per pass: several passes per WatchdogSec at the default interval.
    from fleetd.config import FleetConfig

    assert int(service("fleetd.service")["WatchdogSec"]) >= 3 * FleetConfig().reconcile_interval_s
    # The agent needs its GPUs: no PrivateDevices there, but the controller units have it.
    assert "PrivateDevices" not in service("fleet-agent.service")
    assert service("fleetd.service")["PrivateDevices"] == "yes"


def test_rendezvous_survives_controller_restarts():
    rdzv = unit("fleetd-rendezvous.service")
    controller = unit("fleetd.service")
    for key in ("PartOf", "BindsTo", "Requires", "Requisite"):
        assert key not in rdzv["Unit"], key
        assert "fleetd-rendezvous.service" not in " ".join(controller["Unit"].get(key, [])), key
    assert "fleetd-rendezvous.service" in " ".join(controller["Unit"]["Wants"])
    # The store is unauthenticated: the unit fences it to private networks as well.
    assert service("fleetd-rendezvous.service")["IPAddressDeny"] == "any"


# ---------------------------------------------------------------- several fleets on one control host
TEMPLATES = ("fleetd@.service", "fleetd-rendezvous@.service")


@pytest.fixture
def instance_units(tmp_path: Path) -> list[Path]:
    """The two templates as instances of two fleets (jobA, jobB), as systemctl would load them."""
    paths = []
    for name in TEMPLATES:
        text = (ROOT / "systemd" / name).read_text()
        assert PROD_BIN in text, f"{name} should run the production venv's entry point"
        for fleet in ("jobA", "jobB"):
            path = tmp_path / name.replace("@.", f"@{fleet}.")
            path.write_text(text.replace(PROD_BIN, VENV_BIN))
            paths.append(path)
    return paths


def test_systemd_analyze_verify_passes_on_the_template_instances(instance_units):
    result = verify(instance_units)
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr


@pytest.mark.parametrize("name,max_exposure", [("fleetd@.service", 2.0), ("fleetd-rendezvous@.service", 2.0)])
def test_template_hardening_matches_the_single_fleet_units(instance_units, name, max_exposure):
    path = next(p for p in instance_units if p.name == name.replace("@.", "@jobA."))
    result = subprocess.run(
        [systemd_analyze(), "security", "--offline=true", f"--threshold={int(max_exposure * 10)}", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    overall = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0, overall


@pytest.mark.parametrize(
    "template,single",
    [
        ("fleetd@.service", "fleetd.service"),
        ("fleetd-rendezvous@.service", "fleetd-rendezvous.service"),
    ],
)
def test_a_template_is_its_single_unit_with_one_config_and_state_dir_per_fleet(template, single):
    t, s = service(template), service(single)
    # Same daemon, same sandbox and restart policy: only what names the fleet differs.
    differs = {"ExecStart", "StateDirectory", "Environment"}
    assert {k: v for k, v in t.items() if k not in differs} == {k: v for k, v in s.items() if k not in differs}
    assert shlex.split(t["ExecStart"])[-2:] == ["--config", "/etc/fleetd/%i.toml"]
    assert unit(template)["Service"]["StateDirectory"] == ["fleetd/%i"]
    assert "FLEETD_FLEET__STATE_DIR=/var/lib/fleetd/%i" in unit(template)["Service"]["Environment"]


def test_each_controller_instance_wants_its_own_rendezvous_and_never_binds_it():
    controller = unit("fleetd@.service")["Unit"]
    assert "fleetd-rendezvous@%i.service" in " ".join(controller["Wants"])
    assert "fleetd-rendezvous@%i.service" in " ".join(controller["After"])
    for key in ("PartOf", "BindsTo", "Requires", "Requisite"):
        assert key not in unit("fleetd-rendezvous@.service")["Unit"], key
        assert key not in controller, key


def test_the_state_dir_override_the_template_sets_is_one_fleetd_reads(tmp_path, monkeypatch):
    from fleetd.config import FleetdConfig
    from fleetd.shared.settings import load_settings

    conf = tmp_path / "jobA.toml"
    conf.write_text('[fleet]\nname = "jobA"\nstate_dir = "/var/lib/fleetd"\n')
    monkeypatch.setenv("FLEETD_FLEET__STATE_DIR", "/var/lib/fleetd/jobA")
    assert load_settings(FleetdConfig, conf).fleet.state_dir == Path("/var/lib/fleetd/jobA")
