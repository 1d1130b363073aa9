"""fleetd reads torch's private rendezvous state: a torch outside the tested range is refused at
start with the reason, by the controller, the store host and the node agent alike."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fleetd.shared.torch_support import ALLOW_ENV, TESTED_BELOW, TESTED_MIN, untested_torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("version", ["2.11.0", "2.13.0", "2.13.0+cpu", "2.11.0+cu130"])
def test_tested_releases_pass(version: str) -> None:
    assert untested_torch(version) is None


@pytest.mark.parametrize("version", ["2.3.1", "2.14.1", "3.0.0", "nonsense"])
def test_other_releases_are_refused_with_the_fix(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    why = untested_torch(version)
    assert why is not None and version in why and "pip install" in why and ALLOW_ENV in why
    monkeypatch.setenv(ALLOW_ENV, "1")
    assert untested_torch(version) is None


def test_the_installed_torch_is_a_tested_one() -> None:
    assert untested_torch() is None


def test_pyproject_pins_the_same_range() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [d for d in deps if d.startswith("torch")]
    lo, hi = ".".join(map(str, TESTED_MIN)), ".".join(map(str, TESTED_BELOW))
    assert torch == f"torch>={lo},<{hi}"
    image = (ROOT / "deploy/image/provision.sh").read_text()
    assert f"TORCH_SPEC:-torch>={lo},<{hi}" in image


def test_every_entry_point_refuses_an_untested_torch(tmp_path: Path) -> None:
    # A fake torch distribution on the path, ahead of the real one.
    site = tmp_path / "site"
    dist = site / "torch-2.99.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.99.0\n")
    env = {"PYTHONPATH": f"{site}:{ROOT}", "PATH": "/usr/bin:/bin"}
    for argv in (
        ["-m", "fleetd.cli", "run", "--config", "/nonexistent.toml"],
        ["-m", "fleetd.cli", "rendezvous", "--config", "/nonexistent.toml"],
        ["-m", "agent.cli", "run", "--config", "/nonexistent.toml"],
        ["-m", "agent.cli", "config", "check", "--config", "/nonexistent.toml"],
    ):
        out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 2 and "torch 2.99.0 is outside the range" in out.stderr, (argv, out.stderr)
