"""A user's own job file through the whole stack (`fleetd demo --job FILE`: moto, mosquitto,
fleetd, agents, real torchrun): the PyTorch DDP tutorial's script, which imports nothing from
fleetd, shipped as a workdir. The controller packs and uploads it; each node learns the job and
its version from the launch template's user data, downloads and verifies the archive, runs the
setup (pip, in the job's virtualenv) and trains in folder mode.

- Through the short scenario's notices and loss without notice: every restart of every rank
  resumes from the newest epoch saved anywhere (folder_gate.py), and the job SUCCEEDS.
- `fleetd job submit` of a changed workdir while it trains: the whole world moves to the new
  version, from the old version's last save, and never runs both.
- The project changed to raise: the job FAILS after its restarts, nothing billed afterwards.

Folder mode reports no steps, so what a restart rolled back is read from the script's own lines
in the control host's copy of the logs (which outlives the nodes): "Epoch N | Training snapshot
saved" and "Resuming training from snapshot at Epoch K"."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetd.jobs.pack import pack
from tests.test_demo import _demo, _explain, _survivors

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "examples" / "ddp-job"
SAVED = re.compile(r"Epoch (\d+) \| Training snapshot saved")
RESUMED = re.compile(r"Resuming training from snapshot at Epoch (\d+)")


def _project(tmp_path: Path, epochs: int = 30, save_every: int = 3, name: str = "project") -> Path:
    project = tmp_path / name
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("snapshots"))
    job = project / "job.toml"
    text = job.read_text().replace('args = ["30", "3",', f'args = ["{epochs}", "{save_every}",')
    if save_every == 1:  # a save every epoch (~1.5 s): the folder settles faster than that
        text = text.replace('"--sleep", "0.01"', '"--sleep", "0.05"').replace("settle_s = 2.0", "settle_s = 0.5")
    job.write_text(text)
    return project


def _node_dirs(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "work" / "nodes").glob("i-*"))


def _lines(tmp_path: Path) -> list[tuple[str, str, str]]:
    """(time, node, text) of every worker line the control host holds, in time order."""
    rows = []
    for log in (tmp_path / "work" / "state" / "logs" / "ddp-tutorial").glob("i-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            parts = line.split(" ", 2)
            if len(parts) == 3:
                rows.append((parts[0], log.stem, parts[2]))
    return sorted(rows)


def _rollbacks(tmp_path: Path) -> list[tuple[str, int, int]]:
    """For each resume: (node, epoch resumed, newest epoch any node had saved by then)."""
    newest, out = -1, []
    for _at, node, text in _lines(tmp_path):
        if m := SAVED.search(text):
            newest = max(newest, int(m.group(1)))
        elif m := RESUMED.search(text):
            out.append((node, int(m.group(1)), newest))
    return out


def test_a_plain_ddp_script_loses_no_saved_epoch_across_notices_and_succeeds(tmp_path: Path) -> None:
    project = _project(tmp_path, epochs=60, save_every=1)
    digest = pack(project).digest
    res, report, run_id = _demo(tmp_path, "--scenario", "short", "--job", str(project / "job.toml"))
    assert res.returncode == 0, _explain(res, tmp_path)
    assert report["job_state"] == "succeeded", report
    assert report["job_code_digest"] == digest
    assert report["notices"] == 2 and report["notices_seen_by_fleet"] == 2, report
    # Every node ran this version, set up in its virtualenv, in its own folder.
    for node in _node_dirs(tmp_path):
        ws = node / "jobs" / "ddp-tutorial" / digest
        assert (ws / "ready").read_text() == digest, node
        assert "pip install" in (ws / "setup.log").read_text()
        assert (ws / "venv" / "bin" / "python").exists()
    resumes = _rollbacks(tmp_path)
    assert len(resumes) >= 4, resumes  # each notice re-formed the world: every node resumed
    assert [r for r in resumes if r[1] < r[2]] == [], f"a rank resumed behind the newest save: {resumes}"
    # Ahead by one: the worker was stopped between torch.save and the print that follows it (the
    # save counts, its line never came). Further ahead would be a save nobody made.
    assert [r for r in resumes if r[1] > r[2] + 1] == [], f"a resume from a save never made: {resumes}"
    assert any("Epoch 59 |" in text for _t, _n, text in _lines(tmp_path)), "the script's last epoch"
    # Folder mode: fleetd sees no step, and the report does not pretend to.
    assert report["steps_lost"] is None and report["final_step"] is None and report["max_world_size"] is None
    assert report["billing_stopped_after_s"] is not None and report["billing_stopped_after_s"] <= 60, report
    assert _survivors(run_id) == []


def _submit_mid_run(v2: Path, after_epoch: int) -> object:
    """During the demo: once the control host's logs show ``after_epoch`` saved, submit ``v2``."""

    def during(work: Path) -> dict[str, object]:
        logs = work / "state" / "logs" / "ddp-tutorial"
        deadline = time.time() + 240
        while time.time() < deadline:
            text = "".join(p.read_text(errors="replace") for p in logs.glob("i-*.log")) if logs.exists() else ""
            saved = [int(m) for m in SAVED.findall(text)]
            if saved and max(saved) >= after_epoch:
                out = subprocess.run(
                    [sys.executable, "-m", "fleetd.cli", "job", "submit", str(v2 / "job.toml")]
                    + ["--config", str(work / "fleetd.toml")],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                return {"rc": out.returncode, "out": out.stdout + out.stderr, "epoch": max(saved)}
            time.sleep(0.5)
        raise AssertionError(f"epoch {after_epoch} was never saved")

    return during


def test_a_submitted_version_moves_the_whole_world_from_the_last_save(tmp_path: Path) -> None:
    v1 = _project(tmp_path, epochs=30, save_every=1, name="v1")
    v2 = _project(tmp_path, epochs=30, save_every=1, name="v2")
    train = v2 / "train.py"
    train.write_text(train.read_text().replace('print("Loading snapshot")', 'print("Loading snapshot (v2)")'))
    old, new = pack(v1).digest, pack(v2).digest
    assert old != new
    res, report, run_id = _demo(
        tmp_path, "--scenario", "calm", "--nodes", "2", "--job", str(v1 / "job.toml"), during=_submit_mid_run(v2, 6)
    )
    submitted = _demo.during  # type: ignore[attr-defined]
    assert res.returncode == 0, _explain(res, tmp_path)
    assert isinstance(submitted, dict) and submitted["rc"] == 0, submitted
    assert report["job_state"] == "succeeded" and report["job_code_digest"] == new, report
    status = json.loads((tmp_path / "work" / "state" / "job.json").read_text())
    assert status["code_digest"] == new
    # One version per node, and each world one version: the v1 nodes drained before v2 trained.
    v1_nodes, v2_nodes = [], []
    for node in _node_dirs(tmp_path):
        versions = sorted(p.name for p in (node / "jobs" / "ddp-tutorial").iterdir() if p.is_dir())
        assert versions in ([old], [new]), (node, versions)
        (v1_nodes if versions == [old] else v2_nodes).append(node.name)
    assert len(v1_nodes) == 2 and len(v2_nodes) >= 2, (v1_nodes, v2_nodes)
    lines = _lines(tmp_path)
    epochs = [(t, n) for t, n, text in lines if "] Epoch " in text]  # "[GPU0] Epoch 7 | Batchsize ..."
    last_v1 = max(t for t, n in epochs if n in v1_nodes)
    first_v2 = min(t for t, n in epochs if n in v2_nodes)
    assert last_v1 < first_v2, "a v2 rank trained beside a v1 rank"
    # v2 resumed, every rank at one epoch, no older than any save v1 made before its drains went out
    # (a save v1 made after that, before its workers stopped, is the script's interval: lost).
    drained_at = min(
        json.loads(line)["timestamp"][:23]
        for line in (tmp_path / "work" / "fleetd.log").read_text().splitlines()
        if '"command_sent"' in line and '"kind": "drain"' in line
    )
    saved_before = max(int(m.group(1)) for t, _n, text in lines if t[:23] < drained_at and (m := SAVED.search(text)))
    resumes = [r for r in _rollbacks(tmp_path) if r[0] in v2_nodes]
    assert resumes and len({r[1] for r in resumes}) == 1, resumes
    assert resumes[0][1] >= max(saved_before, submitted["epoch"]), (resumes, saved_before)
    assert any(n in v2_nodes and "Loading snapshot (v2)" in text for _t, n, text in lines)
    assert any(n in v2_nodes and "Epoch 29 |" in text for _t, n, text in lines)
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
