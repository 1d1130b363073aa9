"""Goodput events from the trainers' reported progress (fleetd/policy/goodput.py), pure."""

from __future__ import annotations

from dataclasses import replace

from fleetd.policy.goodput import GoodputTracker
from fleetd.policy.ledger import summarize
from fleetd.policy.ledger_events import IdleGpuTime, RecoveryTime, StepReached, StepsLost
from fleetd.policy.model import Market, Node, NodePhase, PoolId

POOL = PoolId("g5.xlarge", "us-east-1a")


def _node(iid: str, step: int | None, at: float, *, rate: float = 1.0, util: float | None = None) -> Node:
    return Node(iid, POOL, Market.SPOT, 1.0, launched_at=0.0, phase=NodePhase.RUNNING, last_seen_at=at,
                step=step, steps_per_s=rate if step is not None else None, gpu_util_pct=util)


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
    events = _run(t, [(1.0, [_node("a", 100, 1.0), _node("b", 98, 1.0)]),
                      (2.0, [_node("b", 99, 2.0)])])  # a left; b was one report behind
    assert not [e for e in events if isinstance(e, StepsLost)]


def test_idle_gpu_time_from_utilisation_and_from_a_trainer_that_does_not_advance() -> None:
    t = GoodputTracker()
    t.observe([_node("gpu", 5, 0.0, util=3.0), _node("cpu", 5, 0.0)], 0.0)
    events = t.observe([_node("gpu", 6, 10.0, util=3.0), _node("cpu", 5, 10.0), _node("ok", 6, 10.0, util=90.0)],
                       10.0, {"g5.xlarge": 4})
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
