"""The chaos bench's pure measurements on hand-written trainer traces: when training is steady
again after a fault, and how many steps a fault made the job do again."""

from __future__ import annotations

from bench.chaos_checks import steady_now, steps_lost, training_again_at


def steps(t0: float, t1: float, first: int, pid: int = 1, every: float = 0.5) -> list[dict]:
    out, t, s = [], t0, first
    while t <= t1:
        out.append({"ev": "step", "t": t, "step": s, "pid": pid, "rank": 0, "world": 1})
        t += every
        s += 1
    return out


def start(t: float, from_step: int, pid: int) -> dict:
    return {"ev": "start", "t": t, "from_step": from_step, "pid": pid, "rank": 0, "world": 1}


def times(recs: list[dict]) -> list[tuple[float, int]]:
    return [(r["t"], r["step"]) for r in recs if r["ev"] == "step"]


def test_uninterrupted_training_is_steady_at_the_fault_itself() -> None:
    recs = steps(0, 60, 1)
    assert training_again_at(times(recs), after=20.0, now=60.0, window_s=10, gap_s=4) == 20.0
    assert steady_now(times(recs), now=60.0, window_s=10, gap_s=4)


def test_a_pause_moves_recovery_to_the_first_step_of_the_steady_stretch() -> None:
    recs = steps(0, 20, 1) + steps(35, 60, 100)
    assert training_again_at(times(recs), after=20.0, now=60.0, window_s=10, gap_s=4) == 35.0
    early = steps(0, 20, 1) + steps(35, 40, 100)  # as seen at t=40: only 5 s since it came back
    assert not steady_now(times(early), now=40.0, window_s=10, gap_s=4)
    assert training_again_at(times(early), after=20.0, now=40.0, window_s=10, gap_s=4) is None


def test_stopped_training_is_not_steady() -> None:
    recs = steps(0, 20, 1)
    assert training_again_at(times(recs), after=20.0, now=60.0, window_s=10, gap_s=4) is None
    assert not steady_now(times(recs), now=60.0, window_s=10, gap_s=4)


def test_steps_lost_is_the_rollback_of_the_world_that_goes_on() -> None:
    # Step 40 done before the fault at t=20; the new world resumes from 30: 10 steps done again.
    recs = steps(0, 19.5, 1) + [start(25, 30, pid=2)] + steps(25.5, 40, 31, pid=2)
    assert steps_lost(recs, since=20.0, until=40.0) == 10


def test_a_short_lived_world_from_an_old_step_costs_nothing_when_the_next_resumes_from_a_peer() -> None:
    # One node re-forms alone from an old local step (810) and does one step; the world that then
    # forms resumes from a peer's newer state (1779) and goes on: nothing was done again.
    before = steps(0, 4.5, 1770)  # 1770..1779
    recs = (
        before
        + [start(12, 810, pid=2), {"ev": "step", "t": 12.5, "step": 811, "pid": 2}, start(20, 1779, pid=3)]
        + steps(20.5, 30, 1780, pid=3)
    )
    assert steps_lost(recs, since=11.0, until=30.0) == 0


def test_no_restart_no_loss_and_a_pending_restart_counts_its_best_resumption() -> None:
    assert steps_lost(steps(0, 30, 1), since=10.0, until=30.0) == 0
    recs = steps(0, 10, 1) + [start(15, 5, pid=2)]  # resumed from 5, no step past 21 yet
    assert steps_lost(recs, since=10.5, until=30.0) == 21 - 5
