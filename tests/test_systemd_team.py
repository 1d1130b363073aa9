"""systemd/fleetd-team.service: verify-clean, locked down, runs the team loop on the team config
and may write only the jobs' state directories (their allotment files)."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from tests.test_systemd import PROD_BIN, ROOT, VENV_BIN, service, systemd_analyze, verify

NAME = "fleetd-team.service"


def local_unit(tmp_path: Path) -> Path:
    text = (ROOT / "systemd" / NAME).read_text()
    assert PROD_BIN in text
    path = tmp_path / NAME
    path.write_text(text.replace(PROD_BIN, VENV_BIN))
    return path


def test_the_team_unit_verifies_and_is_locked_down(tmp_path: Path) -> None:
    path = local_unit(tmp_path)
    result = verify([path])
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr
    security = subprocess.run(
        [systemd_analyze(), "security", "--offline=true", "--threshold=20", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    overall = security.stdout.strip().splitlines()[-1]
    assert security.returncode == 0 and float(overall.split(":")[-1].split()[0]) <= 2.0, overall


def test_the_team_unit_runs_the_team_loop_as_the_fleetd_user_and_writes_only_job_state() -> None:
    s = service(NAME)
    assert shlex.split(s["ExecStart"]) == [PROD_BIN + "fleetd", "team", "run", "--config", "/etc/fleetd/team.toml"]
    assert s["User"] == s["Group"] == service("fleetd@.service")["User"]
    assert s["ReadWritePaths"] == "/var/lib/fleetd" and s["ProtectSystem"] == "strict"
    # Files, and /metrics on the loopback: no other address may reach it or be reached.
    assert s["IPAddressDeny"] == "any" and s["IPAddressAllow"] == "localhost"
    assert s["Restart"] == "on-failure" and s["KillMode"] == "mixed" and int(s["TimeoutStopSec"]) >= 10
