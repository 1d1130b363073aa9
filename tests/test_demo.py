"""`fleetd demo` end to end: the local cloud, the real daemons, real torchrun, injected
interruptions. Slow (minutes), so marked; CI runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow
MARKER = "FLEETDEMO_TEST_RUN"


def _demo(tmp_path: Path, *args: str, timeout: float = 420) -> tuple[subprocess.CompletedProcess, dict, str]:
    run_id = uuid.uuid4().hex
    report = tmp_path / "report.json"
    env = {**os.environ, MARKER: run_id}  # every descendant inherits it: how strays are found
    res = subprocess.run(
        [sys.executable, "-m", "fleetd.cli", "demo", "--workdir", str(tmp_path / "work"),
         "--report", str(report), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    data = json.loads(report.read_text()) if report.exists() else {}
    return res, data, run_id


def _survivors(run_id: str) -> list[str]:
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.environ().get(MARKER) == run_id:
                out.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def _explain(res: subprocess.CompletedProcess, tmp_path: Path) -> str:
    logs = sorted((tmp_path / "work").glob("*.log"))
    tails = "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:]) for p in logs)
    return f"rc={res.returncode}\nstdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}\n{tails}"


def test_short_scenario_end_to_end(tmp_path: Path) -> None:
    res, report, run_id = _demo(tmp_path, "--scenario", "short", "--duration", "70")
    assert res.returncode == 0, _explain(res, tmp_path)
    for key in ("notices", "steps_lost", "replacements", "max_world_size", "final_step", "spend_usd",
                "budget_usd", "on_demand_equivalent_usd", "resume_latency_s", "checkpoints_durable"):
        assert key in report, key
    assert report["notices"] >= 2
    # One node lost with no notice: the survivors save the step they completed (and re-form
    # when the steering pokes them), so it costs no step either.
    assert report["losses_without_notice"] == 1
    assert report["steps_lost"] == 0, report
    assert report["replacements"] >= 1, report
    assert report["max_world_size"] >= 3
    assert report["final_step"] > 0
    assert report["checkpoints_durable"] >= 1
    assert len(report["resume_latency_s"]) >= 2
    assert 0 < report["spend_usd"] <= report["budget_usd"]
    assert report["on_demand_equivalent_usd"] > report["spend_usd"]
    assert _survivors(run_id) == []


def test_tiny_budget_ends_with_a_checkpointed_stop(tmp_path: Path) -> None:
    res, report, run_id = _demo(tmp_path, "--scenario", "calm", "--duration", "150", "--budget", "0.02")
    assert res.returncode == 0, _explain(res, tmp_path)
    assert report["stopped_by_budget"] is True, report
    assert report["spend_usd"] <= report["budget_usd"]
    assert report["checkpoints_durable"] >= 1
    assert _survivors(run_id) == []


WAVE_TRACE = Path(__file__).resolve().parent.parent / "bench" / "traces" / "wave.csv"


def test_a_trace_wave_every_removal_a_notice_none_lost(tmp_path: Path) -> None:
    """Two removals in the same millisecond, a replacement removed while it restores, a third
    removal 20 s after the first: each is a notice, each gets a replacement, no step is lost."""
    res, report, run_id = _demo(tmp_path, "--nodes", "4", "--trace", str(WAVE_TRACE), "--duration", "120")
    assert res.returncode == 0, _explain(res, tmp_path)
    log = report["notice_log"]
    assert len(log) == report["notices"] == 4, report
    assert all(n["seen_by_fleet"] for n in log), log
    assert abs(log[0]["at_s"] - log[1]["at_s"]) < 0.05  # the wave's pair, together
    assert [n["replacement"] for n in log] == [False, False, True, False]
    assert log[3]["at_s"] - log[0]["at_s"] >= 19.5
    assert report["steps_lost"] == 0, report
    assert report["replacements"] >= 4, report
    assert _survivors(run_id) == []


def test_storm_takes_the_whole_fleet_and_resumes_from_the_checkpoint_made_inside_the_notice(
    tmp_path: Path,
) -> None:
    res, report, run_id = _demo(tmp_path, "--scenario", "storm", timeout=600)
    assert res.returncode == 0, _explain(res, tmp_path)
    wipe = report["whole_fleet_notice"]
    assert wipe is not None and wipe["nodes"] >= 3, report
    assert wipe["durable_step_before_last_left"] is not None, wipe
    assert wipe["resume_step"] == wipe["durable_step_before_last_left"] == wipe["last_step_before"], wipe
    assert wipe["steps_lost"] == 0 and report["steps_lost"] == 0, report
    assert report["notices"] == len(report["notice_log"]) >= 6
    assert any(n["replacement"] for n in report["notice_log"])
    assert _survivors(run_id) == []
