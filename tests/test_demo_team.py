"""Three jobs under one team budget through the whole stack (`fleetd demo --scenario team`):
three real job controllers (team members), their rendezvous hosts and nodes with real torchrun,
and `fleetd team run` over them. The team's burn is cut: the lowest-priority job is paused through
its coordinated checkpoint and its node released while the others train on; spot capacity is
withdrawn from us-east-1 and the burn comes back: the paused job may resume, but only elsewhere,
so the team moves it to us-west-2 (checkpoint copied to that region's bucket, its daemon started
again there) and it resumes on a node there from that checkpoint, 0 steps lost; nobody else was
stopped or moved."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_demo import _demo, _explain, _survivors

pytestmark = pytest.mark.slow


def test_the_team_pauses_its_lowest_job_then_moves_it_to_the_region_with_spot_losing_nothing(tmp_path: Path) -> None:
    res, report, run_id = _demo(tmp_path, "--scenario", "team", timeout=900)
    assert res.returncode == 0 and report.get("failure") is None, _explain(res, tmp_path)
    jobs = {j["name"]: j for j in report["jobs"]}
    assert {n: j["priority"] for n, j in jobs.items()} == {"prod": 10, "dev": 5, "sweep": 0}
    assert all(j["final_step"] > 0 and j["steps_lost"] == 0 for j in jobs.values())
    assert {n: j["region"] for n, j in jobs.items()} == {"prod": "us-east-1", "dev": "us-east-1", "sweep": "us-west-2"}
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
    (move,) = report["region_moves"]
    assert (move["job"], move["from"], move["to"]) == ("sweep", "us-east-1", "us-west-2"), move
    # The checkpoint the pause made durable went with it: the node in us-west-2 started from it.
    assert move["resumed_from"] == pause["durable_step"] and move["steps_lost"] == 0, move
    assert move["resumed_in_zone"].startswith("us-west-2") and move["objects_copied"] >= 1, move
    assert "team_region_moved" in logs["sweep"] and "team_region" not in logs["prod"] + logs["dev"]
    assert report["others_trained_on"] and report["story_told"]
    assert _survivors(run_id) == []
