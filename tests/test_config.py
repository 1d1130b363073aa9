"""Config: TOML + FLEETD_ environment; `config check` exits 0 with secrets redacted, or 2 naming
every invalid field with a plain reason and no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from fleetd.config import FleetdConfig
from fleetd.shared.settings import ConfigError, load_settings

VALID = """
[aws]
region = "eu-west-1"
endpoint_url = "http://127.0.0.1:5000"

[fleet]
name = "llm-a"
min_nodes = 2
max_nodes = 8

[capacity]
instance_types = ["g5.xlarge", "g6.xlarge"]
zones = ["eu-west-1a", "eu-west-1b"]

[budget]
total_usd = 250.0
max_usd_per_hour = 12.5

[mqtt]
url = "mqtts://broker.internal:8883"
username = "fleetd"
password = "hunter2"

[rendezvous]
host = "10.0.0.5"
port = 29400

[checkpoints]
bucket = "my-ckpts"
prefix = "runs"
keep = 2

[job]
entrypoint = "train.py"
module = false
args = ["--lr", "3e-4"]
nproc_per_node = 4
"""


def _write(tmp_path: Path, text: str, name: str = "fleetd.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("FLEETD_")}
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", "import sys; from fleetd.cli import main; sys.exit(main())", *args],
        capture_output=True,
        text=True,
        env=e,
        timeout=60,
    )


def _agent_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import sys; from agent.cli import main; sys.exit(main())", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_valid_file_loads(tmp_path: Path) -> None:
    cfg = load_settings(FleetdConfig, _write(tmp_path, VALID))
    assert cfg.fleet.min_nodes == 2 and cfg.budget.total_usd == 250.0
    assert cfg.capacity.instance_types == ("g5.xlarge", "g6.xlarge")
    assert cfg.mqtt.password.get_secret_value() == "hunter2"
    assert cfg.mqtt.port == 8883 and cfg.mqtt.tls


def test_environment_overrides_file_with_nesting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETD_BUDGET__TOTAL_USD", "99.5")
    monkeypatch.setenv("FLEETD_FLEET__NAME", "from-env")
    cfg = load_settings(FleetdConfig, _write(tmp_path, VALID))
    assert cfg.budget.total_usd == 99.5
    assert cfg.fleet.name == "from-env"
    assert cfg.budget.max_usd_per_hour == 12.5  # untouched keys keep the file's value


def test_check_valid_prints_effective_config_with_secrets_redacted(tmp_path: Path) -> None:
    res = _cli("config", "check", "--config", str(_write(tmp_path, VALID)))
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["budget"]["total_usd"] == 250.0
    assert data["mqtt"]["password"] == "**********"
    assert "hunter2" not in res.stdout + res.stderr


def test_check_invalid_names_every_field_and_exits_2(tmp_path: Path) -> None:
    bad = VALID.replace("total_usd = 250.0", "total_usd = -5").replace("[fleet]", "[fleet]\nmax_nodez = 3")
    res = _cli("config", "check", "--config", str(_write(tmp_path, bad)))
    assert res.returncode == 2
    assert "budget.total_usd" in res.stderr and "greater than 0" in res.stderr
    assert "fleet.max_nodez" in res.stderr and "unknown key" in res.stderr
    assert "Traceback" not in res.stderr + res.stdout


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("[fleet]\nmin_nodes = 5\nmax_nodes = 2\n", ["fleet", "min_nodes (5) must be <= max_nodes (2)"]),
        ("[mqtt]\nurl = 'http://x'\n", ["mqtt", "mqtt://"]),
        ("[budget]\nwarn_at = 0.99\nshrink_at = 0.5\n", ["budget", "warn_at <= forbid_on_demand_at"]),
        ("[fleet\nname = 1", ["not valid TOML"]),
        ("[capacity]\ninstance_types = []\n", ["capacity", "instance_types or gpu"]),
        ("[rendezvous]\nport = 'abc'\n", ["rendezvous.port"]),
    ],
)
def test_check_reasons_are_plain(tmp_path: Path, text: str, needles: list[str]) -> None:
    res = _cli("config", "check", "--config", str(_write(tmp_path, text)))
    assert res.returncode == 2
    for n in needles:
        assert n in res.stderr
    assert "Traceback" not in res.stderr


def test_check_missing_file(tmp_path: Path) -> None:
    res = _cli("config", "check", "--config", str(tmp_path / "nope.toml"))
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_env_error_is_reported_too(tmp_path: Path) -> None:
    res = _cli(
        "config", "check", "--config", str(_write(tmp_path, VALID)), env={"FLEETD_BUDGET__MAX_USD_PER_HOUR": "lots"}
    )
    assert res.returncode == 2 and "budget.max_usd_per_hour" in res.stderr


def test_load_raises_config_error_not_validation_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(FleetdConfig, _write(tmp_path, "[budget]\ntotal_usd = 0\n"))
    assert exc.value.problems[0][0] == "budget.total_usd"


def test_agent_config_check(tmp_path: Path) -> None:
    good = _write(tmp_path, '[node]\nfleet = "llm-a"\n[mqtt]\npassword = "s3cret"\n', "agent.toml")
    res = _agent_cli("config", "check", "--config", str(good))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["node"]["fleet"] == "llm-a"
    assert "s3cret" not in res.stdout
    bad = _write(tmp_path, "[node]\npoll_interval_s = 5\nbogus = 1\n", "bad.toml")
    res = _agent_cli("config", "check", "--config", str(bad))
    assert res.returncode == 2
    assert "node.poll_interval_s" in res.stderr and "node.bogus" in res.stderr


def test_help_texts() -> None:
    res = _cli("--help")
    assert res.returncode == 0
    for cmd in ("run", "rendezvous", "demo", "simulate", "report", "status", "config"):
        assert cmd in res.stdout
    res = _agent_cli("--help")
    assert res.returncode == 0 and "run" in res.stdout and "config" in res.stdout


def test_a_trainer_socket_path_too_long_to_bind_is_a_config_error(tmp_path: Path) -> None:
    # Past 107 bytes a unix socket cannot be bound: the agent ran with no trainer channel and fleetd
    # saw no step at all (every demo test under pytest-xdist's longer temporary paths).
    from agent.config import MAX_UNIX_SOCKET_PATH, NodeConfig

    ok = "/run/" + "s" * (MAX_UNIX_SOCKET_PATH - len("/run/"))
    assert NodeConfig(trainer_socket=Path(ok)).trainer_socket == Path(ok)
    with pytest.raises(ValidationError, match="a unix socket path holds at most 107"):
        NodeConfig(trainer_socket=Path(ok + "s"))


def test_a_job_script_beside_its_own_agent_module_is_refused(tmp_path):
    """fleetd's node package is the top-level `agent`: a script whose folder holds an agent.py
    would shadow it in the workers, which then fail with an ImportError naming neither."""
    import pytest as _pytest

    from agent.config import AgentConfig
    from fleetd.shared.settings import JobConfig

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    ok = AgentConfig(job=JobConfig(entrypoint=str(script), module=False))
    assert ok.job.entrypoint == str(script)
    (tmp_path / "agent.py").write_text("")
    with _pytest.raises(ValueError, match="would shadow fleetd's own `agent` package"):
        AgentConfig(job=JobConfig(entrypoint=str(script), module=False))
