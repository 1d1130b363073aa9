"""Two-signal rule (issue 5): lost only on a terminal EC2 state or two independent signals."""

from __future__ import annotations

import pytest

from fleetd.policy.lifecycle import Signal, assess
from fleetd.policy.model import Launch, NodePhase, Terminate
from fleetd.policy.observation import Observation
from fleetd.policy.planner import plan
from tests.policy_fixtures import NOW, A, B, config, node, offer

SILENCE_S = 30.0
QUIET = NOW - 120  # last heard 120 s ago: more than SILENCE_S


@pytest.mark.parametrize(
    ("case", "fields", "lost", "signals", "reason"),
    [
        ("terminal EC2 state alone", {"ec2_state": "terminated"}, True, (), "EC2 reports it terminated"),
        ("shutting-down alone", {"ec2_state": "shutting-down"}, True, (), "EC2 reports it shutting-down"),
        (
            "notice + silence",
            {"notice_at": NOW - 60, "seen": QUIET},
            True,
            (Signal.NOTICE, Signal.SILENCE),
            "two signals (interruption notice + telemetry silence)",
        ),
        (
            "state change + last will",
            {"ec2_state": "stopping", "agent_offline_at": NOW - 5, "seen": NOW - 10},
            True,
            (Signal.LAST_WILL, Signal.STATE_CHANGE),
            "two signals (agent offline (last will) + EC2 state change)",
        ),
        ("missed heartbeat alone", {"seen": QUIET}, False, (Signal.SILENCE,), "not lost until a second"),
        ("notice alone", {"notice_at": NOW - 60}, False, (Signal.NOTICE,), "not lost until a second"),
        (
            "last will alone",
            {"agent_offline_at": NOW - 5, "seen": NOW - 6},
            False,
            (Signal.LAST_WILL,),
            "not lost until a second",
        ),
        (
            "offline then back online is no signal",
            {"agent_offline_at": NOW - 50, "seen": NOW - 2},
            False,
            (),
            "is healthy",
        ),
        ("booting node is not silent", {"seen": None, "phase": NodePhase.PENDING}, False, (), "is healthy"),
    ],
)
def test_two_signal_rule(case, fields, lost, signals, reason) -> None:
    verdict = assess(node("i-1", **fields), NOW, SILENCE_S)
    assert verdict.lost is lost, case
    assert verdict.signals == signals, case
    assert reason in verdict.reason, case


def _plan_for(n):
    cfg = config(fleet={"min_nodes": 1, "max_nodes": 1}, rebalance={"silence_s": SILENCE_S})
    obs = Observation(nodes=(n,), offers=(offer(A, 0.4), offer(B, 0.5)), target_nodes=1, last_scaling_at=NOW)
    return plan(obs, cfg, NOW)


def test_planner_terminates_and_replaces_a_node_lost_by_two_signals() -> None:
    result = _plan_for(node("i-1", notice_at=NOW - 125, seen=QUIET, notice_deadline=NOW - 5))
    (term,) = result.of_type(Terminate)
    assert term.instance_id == "i-1"
    assert "lost: two signals" in term.reason and "stops billing" in term.reason
    (launch,) = result.of_type(Launch)
    # The replacement avoids the pool that is interrupting now.
    assert launch.count == 1 and launch.pools == (B,)


def test_planner_never_recovers_on_a_missed_heartbeat_alone() -> None:
    result = _plan_for(node("i-1", seen=QUIET))
    assert result.actions == ()
    assert any("no action" in n for n in result.notes)


def test_broken_boot_is_replaced_only_while_other_nodes_report() -> None:
    cfg = config(fleet={"min_nodes": 2, "max_nodes": 2}, capacity={"boot_timeout_s": 900.0})
    stuck = node("i-9", B, phase=NodePhase.PENDING, seen=None, launched_at=NOW - 901)
    talking = node("i-1")
    obs = Observation(nodes=(talking, stuck), offers=(offer(A, 0.4),), target_nodes=2, last_scaling_at=NOW)
    result = plan(obs, cfg, NOW)
    (term,) = result.of_type(Terminate)
    assert term.instance_id == "i-9"
    assert term.reason == ("i-9 never reported in 901 s (boot_timeout_s 900) while other nodes do: broken boot")
    assert [a.count for a in result.of_type(Launch)] == [1]
    # Nobody reports (broker or intake down): replacing nodes would not help.
    silent = node("i-1", seen=None, phase=NodePhase.PENDING, launched_at=NOW - 5000)
    quiet = plan(
        Observation(nodes=(silent, stuck), offers=(offer(A, 0.4),), target_nodes=2, last_scaling_at=NOW), cfg, NOW
    )
    assert quiet.actions == ()


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"phase": NodePhase.LEAVING}, "i-1 has left the rendezvous: terminating it"),
        (
            {"phase": NodePhase.DRAINING, "notice_at": NOW - 130, "notice_deadline": NOW - 10},
            "i-1 drain overdue (notice deadline passed 10 s ago): terminating it",
        ),
        (
            {"phase": NodePhase.DRAINING, "drain_started_at": NOW - 301},
            "i-1 drain overdue (draining for 301 s > drain_timeout_s 300): terminating it",
        ),
    ],
)
def test_leaving_and_overdue_drains_are_terminated(fields, reason) -> None:
    cfg = config(fleet={"min_nodes": 0, "max_nodes": 1}, rebalance={"drain_timeout_s": 300.0})
    obs = Observation(nodes=(node("i-1", **fields),), offers=(), target_nodes=0, last_scaling_at=NOW)
    (term,) = plan(obs, cfg, NOW).actions
    assert isinstance(term, Terminate) and term.reason == reason


def test_a_drain_in_time_is_left_alone() -> None:
    cfg = config(fleet={"min_nodes": 0, "max_nodes": 1})
    draining = node("i-1", phase=NodePhase.DRAINING, drain_started_at=NOW - 20)
    obs = Observation(nodes=(draining,), offers=(), target_nodes=0, last_scaling_at=NOW)
    assert plan(obs, cfg, NOW).actions == ()


@pytest.mark.parametrize(
    ("fields", "terminated"),
    [
        ({"drain_started_at": NOW - 12, "left_at": NOW - 2}, True),  # left after its drain
        ({"notice_at": NOW - 30, "notice_deadline": NOW + 90, "left_at": NOW - 5}, True),  # after its notice
        ({"drain_started_at": NOW - 12, "left_at": NOW - 600}, False),  # an old crash, not a departure
        ({"drain_started_at": NOW - 12}, False),  # still checkpointing and uploading
    ],
)
def test_a_drained_node_is_terminated_as_soon_as_it_has_left(fields, terminated) -> None:
    cfg = config(fleet={"min_nodes": 0, "max_nodes": 1})
    draining = node("i-1", phase=NodePhase.DRAINING, **fields)
    result = plan(Observation(nodes=(draining,), offers=(), target_nodes=0, last_scaling_at=NOW), cfg, NOW)
    if terminated:
        (term,) = result.actions
        assert isinstance(term, Terminate) and term.instance_id == "i-1"
        assert term.reason == (
            f"i-1 has left the rendezvous (trainer exited {NOW - fields['left_at']:.0f} s ago, after its "
            "drain): terminating it so it stops billing"
        )
    else:
        assert result.actions == ()


def test_a_noticed_node_is_left_to_its_notice_flow_until_the_deadline() -> None:
    """A store or broker that lags under load is not a second source while the notice runs: the
    node is checkpointing and uploading; cutting it short could lose the notice's checkpoint."""
    busy = node("i-1", notice_at=NOW - 1, notice_deadline=NOW + 119, seen=QUIET)
    verdict = assess(busy, NOW, SILENCE_S)
    assert not verdict.lost and verdict.signals == (Signal.SILENCE,)
    assert assess(node("i-1", notice_at=NOW - 121, notice_deadline=NOW - 1, seen=QUIET), NOW, SILENCE_S).lost
