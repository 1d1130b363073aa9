"""A job's end through the whole stack (`fleetd demo`: moto, mosquitto, fleetd, agents, real
torchrun): a bug in the job's code is restarted job.max_restarts times and then FAILS the job,
and `fleetd cancel` ends it with a durable checkpoint; either way fleetd releases every node and
billing stops. (The short scenario's test in tests/test_demo.py is the job that SUCCEEDS.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetd.demo.progress import Progress
from tests.test_demo import _demo, _explain, _survivors

pytestmark = pytest.mark.slow


def test_a_bug_in_the_job_fails_it_after_its_restarts_and_stops_billing(tmp_path: Path) -> None:
    args = ("--scenario", "calm", "--nodes", "1", "--steps", "100000", "--fail-at-step", "60", "--duration", "300")
    res, report, run_id = _demo(tmp_path, *args)
    assert res.returncode == 0, _explain(res, tmp_path)
    assert report["job_state"] == "failed", report
    # job.max_restarts (3) restarts, each from the last checkpoint, then no more.
    assert report["job_restarts"] == 3 and "3 restarts used" in report["job_reason"], report
    assert "the job's code exited with 1" in report["job_reason"]
    assert report["final_step"] < 60
    # Released at once: the trainer had exited, nothing was left to save.
    assert report["billing_stopped_after_s"] is not None and report["billing_stopped_after_s"] <= 60, report
    agent_logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "work" / "nodes").glob("*/agent.log"))
    assert "trainer_user_failure" in agent_logs  # the agent ended torchrun's own restarts
    torchrun_logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "work" / "nodes").glob("*/torchrun.log"))
    # 4 attempts (the first and 3 restarts), each ended at its first failure, not after 100.
    assert torchrun_logs.count("failed (exitcode:") <= 8, torchrun_logs[-2000:]
    assert _survivors(run_id) == []


def _cancel_once_training(workdir: Path, timeout: float = 240.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if Progress.load(workdir / "trainer-events.jsonl").final_step >= 30:
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the demo never trained 30 steps")
    out = subprocess.run(
        [sys.executable, "-m", "fleetd.cli", "cancel", "--config", str(workdir / "fleetd.toml"), "--reason", "test"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return time.time()


def test_cancel_checkpoints_then_releases_every_node(tmp_path: Path) -> None:
    args = ("--scenario", "calm", "--nodes", "1", "--steps", "100000", "--duration", "300")
    res, report, run_id = _demo(tmp_path, *args, during=_cancel_once_training)
    assert res.returncode == 0, _explain(res, tmp_path)
    assert not isinstance(_demo.during, BaseException), _demo.during  # type: ignore[attr-defined]
    assert report["job_state"] == "cancelled" and "test" in report["job_reason"], report
    # The coordinated stop's checkpoint is durable, at or past the last step trained.
    assert report["newest_durable_step"] is not None and report["newest_durable_step"] >= report["final_step"] - 1
    assert report["steps_lost"] == 0
    assert report["billing_stopped_after_s"] is not None and report["billing_stopped_after_s"] <= 60, report
    assert _survivors(run_id) == []
