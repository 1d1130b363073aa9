"""Three jobs under one team budget through the whole stack (`fleetd demo --scenario team`):
three real job controllers (team members), their rendezvous hosts and nodes with real torchrun,
and `fleetd team run` over them. The team's burn is cut: the lowest-priority job is paused through
its coordinated checkpoint and its node released while the others train on; the burn comes back:
it resumes on a fresh node from that checkpoint, 0 steps lost, and nobody else was stopped."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_demo import _demo, _explain, _survivors

pytestmark = pytest.mark.slow


def test_the_team_pauses_its_lowest_job_with_a_checkpoint_and_resumes_it_losing_nothing(tmp_path: Path) -> None:
    res, report, run_id = _demo(tmp_path, "--scenario", "team", timeout=900)
    assert res.returncode == 0 and report.get("failure") is None, _explain(res, tmp_path)
    jobs = {j["name"]: j for j in report["jobs"]}
    assert {n: j["priority"] for n, j in jobs.items()} == {"prod": 10, "dev": 5, "sweep": 0}
    assert all(j["final_step"] > 0 and j["steps_lost"] == 0 and j["region"] == "us-east-1" for j in jobs.values())
    (pause,) = report["pauses"]
    assert pause["job"] == "sweep" and pause["steps_lost"] == 0, pause
    # The pause's coordinated checkpoint is the one the resumed node started from.
    assert pause["resumed_from"] == pause["durable_step"] >= pause["last_step_before"], pause
    assert jobs["sweep"]["final_step"] > pause["last_step_before"]  # it trained again after the pause
    # Only the paused job was stopped: the others trained through the story, never restarted.
    logs = {n: (tmp_path / "work" / f"fleetd-{n}.log").read_text(errors="replace") for n in jobs}
    stop = '"action": "StopJob", "outcome": "done"'
    assert logs["sweep"].count(stop) == 1 and stop not in logs["prod"] + logs["dev"]
    assert 0 < report["team_spend_usd"] <= report["team_budget_usd"]
    assert sum(j["spend_usd"] for j in jobs.values()) == pytest.approx(report["team_spend_usd"], abs=1e-3)
    assert report["region_moves"] == [] and "one region" in report["region_moves_note"]
    assert report["others_trained_on"] and report["story_told"]
    assert _survivors(run_id) == []
