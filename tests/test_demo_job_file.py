"""A user's own job file through the whole stack (`fleetd demo --job FILE`: moto, mosquitto,
fleetd, agents, real torchrun): the PyTorch DDP tutorial's script, which imports nothing from
fleetd, shipped as a workdir. The controller packs and uploads it; each node learns the job and
its version from the launch template's user data, downloads and verifies the archive, runs the
setup (pip, in the job's virtualenv) and trains in folder mode. Finished: SUCCEEDED and every node
released. The same project changed to raise: a new version reaches the nodes, and the job FAILS
after its restarts with nothing billed afterwards."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fleetd.jobs.pack import pack
from tests.test_demo import _demo, _explain, _survivors

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "examples" / "ddp-job"


def _project(tmp_path: Path) -> Path:
    shutil.copytree(EXAMPLE, tmp_path / "project", ignore=shutil.ignore_patterns("snapshots"))
    return tmp_path / "project"


def _node_dirs(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "work" / "nodes").glob("i-*"))


def test_a_job_file_ships_its_workdir_and_succeeds(tmp_path: Path) -> None:
    project = _project(tmp_path)
    digest = pack(project).digest
    res, report, run_id = _demo(
        tmp_path, "--scenario", "calm", "--nodes", "2", "--job", str(project / "job.toml"), "--duration", "300"
    )
    assert res.returncode == 0, _explain(res, tmp_path)
    assert report["job_state"] == "succeeded", report
    assert report["job_code_digest"] == digest
    # Every node ran this version, set up in its virtualenv, in its own folder.
    nodes = _node_dirs(tmp_path)
    assert len(nodes) >= 2
    for node in nodes:
        ws = node / "jobs" / "ddp-tutorial" / digest
        assert (ws / "ready").read_text() == digest, node
        assert "pip install" in (ws / "setup.log").read_text()
        assert (ws / "venv" / "bin" / "python").exists()
    logs = "".join((n / "torchrun.log").read_text(errors="replace") for n in nodes)
    assert "Epoch 29 |" in logs  # the script's last epoch (job.toml: 30 epochs)
    # Folder mode: fleetd sees no step, and the report does not pretend to.
    assert report["steps_lost"] is None and report["final_step"] is None
    assert report["billing_stopped_after_s"] is not None and report["billing_stopped_after_s"] <= 60, report
    assert _survivors(run_id) == []


def test_a_changed_version_that_raises_fails_after_its_restarts(tmp_path: Path) -> None:
    project = _project(tmp_path)
    before = pack(project).digest
    train = project / "train.py"
    text = train.read_text()
    hook = "    def _run_epoch(self, epoch: int) -> None:\n"
    assert hook in text
    train.write_text(
        text.replace(hook, hook + "        if epoch >= 2:\n            raise RuntimeError('a bug at epoch 2')\n")
    )
    digest = pack(project).digest
    assert digest != before
    res, report, run_id = _demo(
        tmp_path, "--scenario", "calm", "--nodes", "1", "--job", str(project / "job.toml"), "--duration", "300"
    )
    assert res.returncode == 0, _explain(res, tmp_path)
    assert report["job_state"] == "failed", report
    assert report["job_code_digest"] == digest
    # job.toml: max_restarts = 2.
    assert report["job_restarts"] == 2 and "2 restarts used" in report["job_reason"], report
    logs = "".join((n / "torchrun.log").read_text(errors="replace") for n in _node_dirs(tmp_path))
    assert "a bug at epoch 2" in logs
    assert report["billing_stopped_after_s"] is not None and report["billing_stopped_after_s"] <= 60, report
    assert _survivors(run_id) == []
