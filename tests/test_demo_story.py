"""When a scripted demo's story is told (fleetd/demo/story.py): pure, from trainer events."""

from __future__ import annotations

from fleetd.demo.progress import Progress
from fleetd.demo.story import OVERTIME_S, SETTLE_S, told_at, training_cap_s


def _step(t: float, rank: int, world: int, step: int) -> dict:
    return {"ev": "step", "t": t, "rank": rank, "world": world, "step": step}


def test_not_told_while_the_fleet_is_short_after_the_last_reclaim() -> None:
    recs = [_step(100.0 + i, r, 4, i) for i in range(3) for r in range(4)]
    recs += [_step(130.0 + i, r, 2, 10 + i) for i in range(5) for r in range(2)]  # two survivors
    assert told_at(Progress(tuple(recs)), played_at=120.0, fleet_size=4) is None


def test_told_once_every_rank_of_the_whole_fleet_stepped_after_the_story() -> None:
    recs = [_step(130.0, r, 2, 10) for r in range(2)]
    # The replacements join: ranks 0-3 of a world of four step at 150.0-150.3.
    recs += [_step(150.0 + r / 10, r, 4, 11) for r in range(4)]
    at = told_at(Progress(tuple(recs)), played_at=120.0, fleet_size=4)
    assert at == 150.3 + SETTLE_S


def test_a_whole_world_before_the_story_ended_does_not_count() -> None:
    # The world was whole before the last reclaim, then nothing was trained after it.
    recs = [_step(110.0 + r / 10, r, 4, 5) for r in range(4)]
    assert told_at(Progress(tuple(recs)), played_at=120.0, fleet_size=4) is None


def test_a_job_that_reports_no_steps_is_never_told() -> None:
    assert told_at(Progress(()), played_at=120.0, fleet_size=3) is None


def test_a_story_not_told_by_its_duration_gets_overtime_and_a_job_does_not() -> None:
    assert training_cap_s(90.0, end_when_told=True) == 90.0 + OVERTIME_S
    assert training_cap_s(90.0, end_when_told=False) == 90.0
