"""fleetd/policy/stall.py: stall detection and the recovery ladder, pure (plain data and now in)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from fleetd.policy.stall import (
    NodeProgress,
    Recovery,
    StallCause,
    StallObservation,
    StallSettings,
    StallTracker,
    assess,
)

S = StallSettings(stall_after_s=60.0, escalate_after_s=30.0, telemetry_fresh_s=10.0)
IDS = ("i-a", "i-b", "i-c")


def nodes(
    step: int | None,
    *,
    running: bool | None = True,
    at: float | None = 0.0,
    billed: bool = True,
    ids: tuple[str, ...] = IDS,
) -> tuple[NodeProgress, ...]:
    return tuple(NodeProgress(i, billed, running, step, at) for i in ids)


def run(ticks, tracker: StallTracker | None = None, settings: StallSettings = S):  # noqa: ANN001
    t = tracker or StallTracker()
    out = []
    for obs in ticks:
        d = assess(t, obs, settings)
        t = d.tracker
        out.append(d)
    return t, out


def test_steady_progress_is_never_a_stall():
    t, out = run(StallObservation(float(now), nodes(now, at=float(now))) for now in range(0, 600, 5))
    assert not any(d.stalled for d in out) and t.episode is None and t.stalled_node_seconds == 0


def test_pauses_shorter_than_the_bound_are_not_stalls():
    ticks = [StallObservation(0, nodes(10)), StallObservation(59, nodes(10, at=59)), StallObservation(60, nodes(11))]
    _, out = run(ticks)
    assert not any(d.stalled for d in out)


def test_a_job_that_never_trained_is_left_to_the_boot_timeout():
    _, out = run(StallObservation(float(now), nodes(None, running=False, at=None)) for now in range(0, 600, 10))
    assert not any(d.stalled for d in out)


def test_store_unreachable_is_detected_once_and_waits_without_touching_nodes():
    ticks = [StallObservation(0, nodes(100))]
    ticks += [
        StallObservation(float(now), nodes(100, running=False, at=float(now)), store_reachable=False)
        for now in range(5, 400, 5)
    ]
    t, out = run(ticks)
    detected = [d for d in out if d.detected]
    assert len(detected) == 1 and detected[0].cause is StallCause.STORE_UNREACHABLE
    assert detected[0].tracker.episode.detected_at == 65.0
    assert not any(d.actions for d in out), "replacing nodes does not bring a store back"
    assert t.episode is not None and t.episode.since == 0


def test_store_restart_gives_trainers_time_then_ends_with_the_recovery_time():
    ticks = [StallObservation(0, nodes(100))]
    ticks += [StallObservation(float(now), nodes(100, running=False), store_reachable=False) for now in (30, 61)]
    ticks += [StallObservation(70, nodes(100, running=True, at=70), store_reachable=True, store_restarted_at=66)]
    ticks += [StallObservation(80, nodes(101, at=80), store_reachable=True, store_restarted_at=66)]
    t, out = run(ticks)
    assert out[3].cause is StallCause.STORE_RESTARTED and not out[3].actions
    ended = out[4].ended
    assert ended is not None and not out[4].stalled
    assert ended.since == 0 and ended.detected_at == 61 and ended.ended_at == 80
    assert ended.duration_s == 80 and ended.recovery_s == 19
    assert ended.node_seconds == 80 * 3, "every billed node for the whole time without a step"
    assert t.history == (ended,) and t.stalled_node_seconds == 240


def test_trainers_exited_climbs_the_ladder_once_per_rung():
    ticks = [StallObservation(0, nodes(5))]
    ticks += [
        StallObservation(float(now), nodes(5, running=False, at=float(now)), store_reachable=True)
        for now in range(10, 400, 10)
    ]
    t, out = run(ticks)
    acted = [(d.tracker.episode.actions[-1][1], a.kind, a.instance_ids) for d in out for a in d.actions]
    assert acted == [
        (70.0, Recovery.RESTART_TRAINERS, IDS),
        (100.0, Recovery.REFORM, ()),
        (130.0, Recovery.REPLACE_NODES, IDS),
    ]
    assert all(d.cause is StallCause.TRAINERS_EXITED for d in out if d.stalled)


def test_restart_targets_only_the_nodes_whose_trainer_stopped():
    mixed = (NodeProgress("i-a", True, True, 5, 70.0), NodeProgress("i-b", True, False, 5, 70.0))
    _, out = run([StallObservation(0, mixed), StallObservation(70, mixed)])
    # One trainer still runs and nothing moves: hung ranks, re-formed first.
    assert out[1].cause is StallCause.RANKS_HUNG and out[1].actions[0].kind is Recovery.REFORM
    s2 = replace(S, escalate_after_s=1)
    _, out = run([StallObservation(0, mixed), StallObservation(70, mixed), StallObservation(72, mixed)], settings=s2)
    assert out[2].actions[0].kind is Recovery.RESTART_TRAINERS and out[2].actions[0].instance_ids == ("i-b",)


def test_hung_ranks_and_silent_agents():
    _, out = run([StallObservation(0, nodes(5)), StallObservation(61, nodes(5, at=61))])
    assert out[1].cause is StallCause.RANKS_HUNG
    _, out = run([StallObservation(0, nodes(5)), StallObservation(61, nodes(5, at=0))])
    assert out[1].cause is StallCause.AGENTS_SILENT


def test_replacing_nodes_can_be_forbidden():
    s = replace(S, replace_nodes=False)
    ticks = [StallObservation(0, nodes(5))]
    ticks += [StallObservation(float(now), nodes(5, running=False, at=float(now))) for now in range(10, 400, 10)]
    _, out = run(ticks, settings=s)
    assert Recovery.REPLACE_NODES not in {a.kind for d in out for a in d.actions}


def test_a_rollback_counts_as_progress():
    ticks = [StallObservation(0, nodes(500)), StallObservation(50, nodes(450)), StallObservation(100, nodes(451))]
    _, out = run(ticks)
    assert not any(d.stalled for d in out)


def test_nothing_billed_or_job_stopping_ends_the_stall():
    ticks = [
        StallObservation(0, nodes(5)),
        StallObservation(61, nodes(5, running=False)),
        StallObservation(70, nodes(5, running=False), training_expected=False),
    ]
    t, out = run(ticks)
    assert out[1].stalled and not out[2].stalled and t.episode is None and len(t.history) == 1


@given(st.lists(st.tuples(st.integers(1, 30), st.booleans(), st.integers(0, 3)), min_size=1, max_size=60))
def test_node_time_is_never_negative_and_only_grows(ticks):
    t = StallTracker()
    now, step, last = 0.0, 0, 0.0
    for dt, moves, billed in ticks:
        now += dt
        step += 1 if moves else 0
        obs = StallObservation(now, nodes(step, at=now, ids=IDS[:billed]))
        t = assess(t, obs, S).tracker
        assert t.stalled_node_seconds >= last - 1e-9
        last = t.stalled_node_seconds
        if t.episode is not None:
            assert t.episode.node_seconds <= (now - t.episode.since) * len(IDS) + 1e-9


# ---------------------------------------------------------------- a rendezvous forming a round
def test_a_job_re_forming_after_a_change_is_not_stalled():
    """A node joined at 50 s: the round re-forms and its workers restart; on a loaded machine the
    first step of the new round comes late. Not "all ranks hung": the clock starts at the change."""
    ticks = [StallObservation(0, nodes(10))]
    ticks += [
        StallObservation(float(now), nodes(10, at=float(now)), rendezvous_changed_at=50.0, rendezvous_forming=now < 80)
        for now in range(5, 110, 5)
    ]
    ticks.append(StallObservation(110, nodes(11, at=110), rendezvous_changed_at=50.0))
    _, out = run(ticks)
    assert not any(d.stalled for d in out)
    assert not [a for d in out for a in d.actions]


def test_a_round_still_forming_is_not_stalled_however_long_the_change_was_ago():
    ticks = [StallObservation(0, nodes(10))]
    ticks += [
        StallObservation(float(now), nodes(10, at=float(now)), rendezvous_changed_at=5.0, rendezvous_forming=True)
        for now in range(5, 300, 5)
    ]
    _, out = run(ticks)
    assert not any(d.stalled for d in out)


def test_a_formed_round_without_a_step_is_a_stall_one_bound_after_it_formed():
    ticks = [StallObservation(0, nodes(10))]
    ticks += [
        StallObservation(float(now), nodes(10, at=float(now)), rendezvous_changed_at=40.0) for now in range(5, 200, 5)
    ]
    _, out = run(ticks)
    first = next(i for i, d in enumerate(out) if d.stalled)
    assert ticks[first].now > 40.0 + S.stall_after_s and ticks[first - 1].now <= 40.0 + S.stall_after_s
    assert out[first].detected and out[first].cause is StallCause.RANKS_HUNG
    # measured from the last step, not from the change: the billed time without a step is honest
    assert out[first].tracker.episode.since == 0


def test_a_rendezvous_that_keeps_re_forming_without_a_step_is_a_stall_after_reforming_max():
    s = replace(S, reforming_max_s=200.0)
    ticks = [StallObservation(0, nodes(10))]
    ticks += [
        StallObservation(
            float(now), nodes(10, at=float(now)), rendezvous_changed_at=float(now - now % 20), rendezvous_forming=True
        )
        for now in range(5, 400, 5)
    ]
    _, out = run(ticks, settings=s)
    first = next(i for i, d in enumerate(out) if d.stalled)
    assert 200.0 < ticks[first].now <= 205.0
    assert out[first].cause is StallCause.RANKS_HUNG and out[first].actions


def test_re_forming_during_a_stall_waits_instead_of_escalating():
    """A recovery poke makes the rendezvous re-form: the next rung waits while it does."""
    ticks = [StallObservation(0, nodes(5)), StallObservation(61, nodes(5, at=61))]
    ticks += [
        StallObservation(float(now), nodes(5, at=float(now)), rendezvous_changed_at=62.0, rendezvous_forming=True)
        for now in range(65, 200, 5)
    ]
    _, out = run(ticks)
    assert out[1].detected and out[1].actions[0].kind is Recovery.REFORM
    assert {d.cause for d in out[2:]} == {StallCause.REFORMING}
    assert not [a for d in out[2:] for a in d.actions]
