"""Goodput events from the trainers' reported progress (fleetd/policy/goodput.py), pure."""

from __future__ import annotations

from dataclasses import replace

from fleetd.policy.goodput import GoodputTracker
from fleetd.policy.ledger import summarize
from fleetd.policy.ledger_events import IdleGpuTime, RecoveryTime, StepReached, StepsLost, StepsRegained
from fleetd.policy.model import Market, Node, NodePhase, PoolId

POOL = PoolId("g5.xlarge", "us-east-1a")


def _node(iid: str, step: int | None, at: float, *, rate: float = 1.0, util: float | None = None) -> Node:
    return Node(
        iid,
        POOL,
        Market.SPOT,
        1.0,
        launched_at=0.0,
        phase=NodePhase.RUNNING,
        last_seen_at=at,
        step=step,
        steps_per_s=rate if step is not None else None,
        gpu_util_pct=util,
    )


def _run(tracker: GoodputTracker, passes: list[tuple[float, list[Node]]]) -> list:
    out = []
    for now, nodes in passes:
        out += tracker.observe(nodes, now)
    return out


def test_steps_progress_loss_and_recovery_from_reports() -> None:
    t = GoodputTracker(stall_after_s=10.0, skew_s=2.0)
    passes = [(float(s), [_node("a", s * 2, s), _node("b", s * 2 - 1, s)]) for s in range(1, 11)]  # to step 20
    # A restart: no progress for 20 s (the nodes keep reporting their last step), then resume at 12.
    passes += [(float(s), [_node("a", 20, s), _node("b", 20, s)]) for s in range(11, 31, 5)]
    passes += [(31.0, [_node("a", 12, 31.0), _node("b", 12, 31.0)])]
    passes += [(float(s), [_node("a", 12 + (s - 31) * 2, s)]) for s in range(32, 40)]
    events = _run(t, passes)
    lost = [e for e in events if isinstance(e, StepsLost)]
    assert [(e.from_step, e.to_step) for e in lost] == [(20, 12)]
    reached = [e.step for e in events if isinstance(e, StepReached)]
    assert reached == sorted(reached) and reached[-1] == 12 + 8 * 2 and 20 in reached
    recovery = [e for e in events if isinstance(e, RecoveryTime)]
    assert len(recovery) == 1 and recovery[0].seconds == 32.0 - 10.0  # last progress at 10 s
    summary = summarize(events, 40.0)
    assert summary.useful_steps == 28 and summary.steps_lost == 8


def test_reporting_skew_is_not_a_loss() -> None:
    t = GoodputTracker(skew_s=5.0)
    events = _run(
        t, [(1.0, [_node("a", 100, 1.0), _node("b", 98, 1.0)]), (2.0, [_node("b", 99, 2.0)])]
    )  # a left; b was one report behind
    assert not [e for e in events if isinstance(e, StepsLost)]


def test_idle_gpu_time_from_utilisation_and_from_a_trainer_that_does_not_advance() -> None:
    t = GoodputTracker()
    t.observe([_node("gpu", 5, 0.0, util=3.0), _node("cpu", 5, 0.0)], 0.0)
    events = t.observe(
        [_node("gpu", 6, 10.0, util=3.0), _node("cpu", 5, 10.0), _node("ok", 6, 10.0, util=90.0)],
        10.0,
        {"g5.xlarge": 4},
    )
    idle = {e.instance_id: e.gpu_seconds for e in events if isinstance(e, IdleGpuTime)}
    assert idle == {"gpu": 40.0, "cpu": 40.0}  # 10 s x 4 GPUs each; "ok" is busy (and new)


def test_stale_reports_and_dead_nodes_do_not_count() -> None:
    t = GoodputTracker(fresh_s=30.0)
    gone = replace(_node("a", 50, 0.0), ec2_state="terminated")
    assert not [e for e in t.observe([gone, _node("b", 70, 0.0)], 100.0) if isinstance(e, StepReached)]


def test_resume_from_the_ledger_never_counts_a_step_twice() -> None:
    t = GoodputTracker()
    t.resume([StepReached(1.0, 40)])
    events = t.observe([_node("a", 30, 5.0, rate=0.0)], 5.0)
    assert [(e.from_step, e.to_step) for e in events if isinstance(e, StepsLost)] == [(40, 30)]
    assert not [e for e in events if isinstance(e, StepReached)]


def _world(step: int, at: float, rate: float = 1.0) -> list[Node]:
    return [_node("a", step, at, rate=rate), _node("b", step, at, rate=rate)]


def test_a_stale_world_overtaken_at_the_high_water_mark_loses_only_the_steps_it_redid() -> None:
    t = GoodputTracker(skew_s=2.0)
    passes = [(float(s), _world(800 + s, float(s))) for s in range(1, 21)]  # to 820, 1 step/s
    passes += [(21.0, _world(800, 21.0))]  # a node restored an older copy: a world at 800
    passes += [(float(s), _world(800 + (s - 21), float(s))) for s in range(22, 27)]  # trains to 805
    passes += [(27.0, _world(821, 27.0))]  # replaced by a world that resumed at 820 (+1 step)
    passes += [(float(s), _world(821 + (s - 27), float(s))) for s in range(28, 31)]
    events = _run(t, passes)
    assert [(e.from_step, e.to_step) for e in events if isinstance(e, StepsLost)] == [(820, 800)]
    assert [e.steps for e in events if isinstance(e, StepsRegained)] == [15]  # 805..820 never redone
    summary = summarize(events, 31.0)
    assert summary.steps_lost == 5 and summary.useful_steps == 824


def test_a_rise_training_could_explain_keeps_the_loss() -> None:
    """Unsure whether the job jumped or trained: the report keeps the larger loss."""
    t = GoodputTracker(skew_s=2.0)
    passes = [(float(s), _world(s * 10, float(s), rate=10.0)) for s in range(1, 11)]  # to 100
    passes += [(11.0, _world(70, 11.0, rate=10.0)), (12.0, _world(100, 12.0, rate=10.0))]  # +30 in 1 s
    events = _run(t, passes)
    assert [(e.from_step, e.to_step) for e in events if isinstance(e, StepsLost)] == [(100, 70)]
    assert not [e for e in events if isinstance(e, StepsRegained)]  # 10 steps/s + 20 of skew
    assert summarize(events, 12.0).steps_lost == 30


def test_steps_trained_again_are_never_regained_by_a_later_jump() -> None:
    t = GoodputTracker(skew_s=1.0)
    passes = [(float(s), _world(100 + s, float(s))) for s in range(1, 21)]  # to 120
    passes += [(21.0, _world(100, 21.0))]  # lost 20
    passes += [(float(s), _world(100 + (s - 21), float(s))) for s in range(22, 42)]  # trains back to 120
    passes += [(42.0, _world(200, 42.0))]  # a jump far above the old mark: nothing to regain
    events = _run(t, passes)
    assert not [e for e in events if isinstance(e, StepsRegained)]
    assert summarize(events, 42.0).steps_lost == 20


def test_regained_steps_survive_the_ledger_store_round_trip_and_never_make_losses_negative() -> None:
    from fleetd.policy.ledger_events import EVENT_KINDS, EVENT_TYPES

    assert EVENT_TYPES[EVENT_KINDS[StepsRegained]] is StepsRegained
    events = [StepReached(1.0, 50), StepsLost(2.0, 50, 40), StepsRegained(3.0, 25)]
    assert summarize(events, 4.0).steps_lost == 0
