"""Graded budget responses and the budget gate (issue 4): each row asserts the action and reason."""

from __future__ import annotations

import pytest

from fleetd.policy.model import (
    BudgetLevel,
    Drain,
    Launch,
    Market,
    NodePhase,
    StopJob,
    Terminate,
    Warn,
)
from fleetd.policy.observation import DesiredJob, Observation, PoolStats
from fleetd.policy.planner import plan
from tests.policy_fixtures import NOW, A, B, config, node, offer

CFG = config(
    fleet={"min_nodes": 1, "max_nodes": 4, "reconcile_interval_s": 10.0},
    budget={
        "total_usd": 100.0,
        "max_usd_per_hour": 20.0,
        "warn_at": 0.8,
        "forbid_on_demand_at": 0.9,
        "shrink_at": 0.95,
        "forecast_horizon_s": 3600.0,
        "stop_reserve_s": 180.0,
    },
)
# Two spot nodes at $5/h (bid $6/h): burn $10/h, so the 1 h forecast is spent + $10.
TWO = (node("i-1", price=5.0, max_price=6.0), node("i-2", B, price=5.0, max_price=6.0))
OFFERS = (offer(A, 5.0, od=6.0), offer(B, 5.0, od=6.0))


def observe(spent: float, **kw) -> Observation:
    base = dict(nodes=TWO, offers=OFFERS, spent_usd=spent, target_nodes=2, last_scaling_at=NOW - 10)
    return Observation(**{**base, **kw})


@pytest.mark.parametrize(
    ("spent", "level", "expected", "reason"),
    [
        (50.0, BudgetLevel.NORMAL, [], "no action: spent $50.00 of $100.00; burn $10.00/h"),
        (71.0, BudgetLevel.WARN, [("Warn", "budget-warn")], "forecast at 81% >= warn_at 80%"),
        (
            81.0,
            BudgetLevel.FORBID_ON_DEMAND,
            [("Warn", "budget-forbid-on-demand")],
            "forecast at 91% >= forbid_on_demand_at 90%: no on-demand launches",
        ),
        (
            86.0,
            BudgetLevel.SHRINK,
            [("Warn", "budget-shrink"), ("Drain", "i-1")],
            "forecast at 96% >= shrink_at 95%: shrinking",
        ),
        (
            # committed = 99.4 + 2 nodes x $6/h x (10 s + 180 s) = 100.03 >= 100
            99.4,
            BudgetLevel.STOP,
            [("StopJob", "")],
            "budget cap reached: committed $100.03",
        ),
    ],
)
def test_graded_responses(spent, level, expected, reason) -> None:
    result = plan(observe(spent), CFG, NOW)
    assert result.budget.level is level
    got = [(type(a).__name__, getattr(a, "code", "") or getattr(a, "instance_id", "")) for a in result.actions]
    assert got == expected
    texts = [a.reason for a in result.actions] + list(result.notes)
    assert any(reason in t for t in texts), texts


def test_shrink_goes_one_node_at_a_time_toward_min_nodes() -> None:
    result = plan(observe(86.0), CFG, NOW)
    assert result.target_nodes == 1
    assert "shrinking from 2 to 1 nodes (toward min_nodes=1)" in " ".join(result.notes)
    (drain,) = result.of_type(Drain)
    assert drain.reason == "scaling to 1 nodes: removing i-1 (spot $5.000/h, running)"
    at_min = plan(observe(92.0, nodes=TWO[:1], target_nodes=1), CFG, NOW)
    assert at_min.budget.level is BudgetLevel.SHRINK
    assert at_min.of_type(Drain) == () and at_min.target_nodes == 1
    assert "already at min_nodes=1" in " ".join(at_min.notes)


def test_warn_is_emitted_when_the_level_rises_not_every_pass() -> None:
    again = plan(observe(71.0, budget_level=BudgetLevel.WARN), CFG, NOW)
    assert again.of_type(Warn) == ()
    assert again.budget.level is BudgetLevel.WARN


def test_forbid_on_demand_blocks_the_fallback() -> None:
    blocked = tuple(PoolStats(p, capacity_error_until=NOW + 300) for p in (A, B))
    cfg = config(budget=CFG.budget.model_dump(), capacity={"spot_wait_s": 60.0}, fleet=CFG.fleet.model_dump())
    result = plan(
        observe(
            86.0,
            nodes=TWO[:1],
            pool_stats=blocked,
            spot_unavailable_since=NOW - 3600,
            budget_level=BudgetLevel.FORBID_ON_DEMAND,
        ),
        cfg,
        NOW,
    )
    assert result.of_type(Launch) == ()
    assert result.spot_short
    assert "on-demand fallback forbidden at budget level forbid-on-demand" in " ".join(result.notes)


def test_stop_requested_by_the_job_and_overdue_stop_terminates() -> None:
    stop = plan(observe(10.0, desired_job=DesiredJob.STOP), CFG, NOW)
    assert [type(a) for a in stop.actions] == [StopJob]
    assert stop.actions[0].reason.startswith("job stop requested: coordinated checkpoint")
    waiting = plan(observe(10.0, stop_issued_at=NOW - 60), CFG, NOW)
    assert waiting.actions == ()
    assert "stopping: 2 nodes finishing checkpoint and shutdown (60 of 180 s)" in waiting.notes
    overdue = plan(observe(10.0, stop_issued_at=NOW - 181), CFG, NOW)
    assert sorted(a.instance_id for a in overdue.of_type(Terminate)) == ["i-1", "i-2"]
    assert "stop issued 181 s ago (stop_reserve_s 180)" in overdue.actions[0].reason
    # The stop's sequence ended (checkpoint saved, agents shut down): the nodes go now, not at the
    # reserve; a completion older than this stop (an earlier one) does not count.
    done = plan(observe(10.0, stop_issued_at=NOW - 20, stop_completed_at=NOW - 5), CFG, NOW)
    assert sorted(a.instance_id for a in done.of_type(Terminate)) == ["i-1", "i-2"]
    assert "the stop is done 5 s ago" in done.actions[0].reason
    stale = plan(observe(10.0, stop_issued_at=NOW - 20, stop_completed_at=NOW - 60), CFG, NOW)
    assert stale.actions == ()


def test_gate_cuts_a_launch_to_the_burn_cap() -> None:
    cfg = config(budget={**CFG.budget.model_dump(), "max_usd_per_hour": 12.0}, fleet=CFG.fleet.model_dump())
    result = plan(observe(0.0, nodes=TWO[:1], target_nodes=3), cfg, NOW)
    (launch,) = result.of_type(Launch)
    assert launch.count == 1
    assert "wanted 2; budget allows 1: $7.00/h left under max_usd_per_hour" in launch.reason
    assert result.budget.burn_usd_per_hour == pytest.approx(10.0)


def test_gate_refuses_a_launch_that_could_cross_total_usd() -> None:
    # 1 node at $6/h worst case over 190 s = $0.32 committed; a launch commits another $0.32.
    # (A short forecast horizon keeps the level below shrink, so the target stays at 2.)
    budget = {
        **CFG.budget.model_dump(),
        "forecast_horizon_s": 60.0,
        "warn_at": 0.99,
        "forbid_on_demand_at": 0.99,
        "shrink_at": 1.0,
    }
    cfg = config(budget=budget, fleet=CFG.fleet.model_dump())
    result = plan(observe(99.5, nodes=TWO[:1], target_nodes=2), cfg, NOW)
    assert result.budget.level is BudgetLevel.FORBID_ON_DEMAND
    assert result.of_type(Launch) == ()
    assert any("not even one fits the budget" in n and "left under total_usd" in n for n in result.notes)


def test_price_rise_sheds_the_priciest_node_to_the_burn_cap() -> None:
    three = (
        node("i-1", price=7.0, max_price=9.0),
        node("i-2", B, price=8.0, max_price=9.0),
        node("i-3", price=7.0, max_price=9.0),
    )
    result = plan(observe(0.0, nodes=three, target_nodes=3), CFG, NOW)
    (drain,) = result.of_type(Drain)
    assert drain.instance_id == "i-2"
    assert drain.reason == "burn $22.00/h exceeds max_usd_per_hour $20.00: removing i-2 ($8.000/h)"
    # ... and the target is met again with a cheaper node: $7 + $7 + $5.
    (launch,) = result.of_type(Launch)
    assert launch.count == 1 and launch.budgeted_price_per_hour == 5.0
    assert result.budget.burn_usd_per_hour == pytest.approx(19.0)


def test_pending_node_excess_is_terminated_not_drained() -> None:
    nodes = TWO + (node("i-3", phase=NodePhase.PENDING, seen=None, launched_at=NOW - 30),)
    result = plan(observe(0.0, nodes=nodes), CFG, NOW)
    (term,) = result.of_type(Terminate)
    assert term.instance_id == "i-3" and term.reason.startswith("scaling to 2 nodes")
    assert all(n.market is Market.SPOT for n in nodes)


def test_status_reports_burn_forecast_and_runway() -> None:
    status = plan(observe(50.0), CFG, NOW).budget
    assert (status.spent_usd, status.burn_usd_per_hour, status.forecast_usd) == (50.0, 10.0, 60.0)
    assert status.runway_h == pytest.approx(5.0)
    # committed: spent + 2 nodes x $6/h worst case x (10 s + 180 s)
    assert status.committed_usd == pytest.approx(50.0 + 12.0 * 190 / 3600)
    assert status.reason.endswith("the budget lasts 5.0 h at this burn")
