"""The planner's memory between passes (fleetd/policy/memory.py): one pure definition that the
reconcile loop, the simulator and the property-test driver all apply, so the simulator keeps
what the daemon keeps."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fleetd.policy.memory import PlannerMemory, after_plan, after_spot_launch, after_stop
from fleetd.policy.model import BudgetLevel, BudgetStatus, Launch, Market, Plan, PoolId

POOL = PoolId("g5.xlarge", "us-east-1a")
ROOT = Path(__file__).resolve().parent.parent


def _spot_launch() -> Launch:
    return Launch(reason="capacity", count=1, market=Market.SPOT, pools=(POOL,))


def test_the_target_and_its_cool_down_start_with_the_first_target_as_the_loop_always_did() -> None:
    m = after_plan(PlannerMemory(), Plan(target_nodes=2), now=10.0)
    assert (m.target_nodes, m.last_scaling_at) == (2, 10.0)
    assert after_plan(m, Plan(target_nodes=2), now=20.0).last_scaling_at == 10.0  # no change, no new cool-down
    m = after_plan(m, Plan(target_nodes=3), now=30.0)
    assert (m.target_nodes, m.last_scaling_at) == (3, 30.0)
    # A plan without a target (a stopping job) keeps the last one.
    assert after_plan(m, Plan(), now=40.0).target_nodes == 3


def test_a_spot_shortage_starts_once_and_ends_by_plan_or_by_launch() -> None:
    m = after_plan(PlannerMemory(), Plan(spot_short=True), now=5.0)
    assert m.spot_unavailable_since == 5.0
    assert after_plan(m, Plan(spot_short=True), now=9.0).spot_unavailable_since == 5.0  # not restarted
    # A plan that tries a spot launch leaves it to the launch's outcome.
    assert after_plan(m, Plan(actions=(_spot_launch(),)), now=9.0).spot_unavailable_since == 5.0
    assert after_plan(m, Plan(), now=9.0).spot_unavailable_since is None  # the need went away
    assert after_spot_launch(m, got_any=True, now=9.0).spot_unavailable_since is None
    assert after_spot_launch(m, got_any=False, now=9.0).spot_unavailable_since == 5.0
    assert after_spot_launch(PlannerMemory(), got_any=False, now=9.0).spot_unavailable_since == 9.0


def test_the_budget_level_follows_the_plan_and_the_first_stop_is_kept() -> None:
    plan = Plan(budget=BudgetStatus(level=BudgetLevel.WARN))
    assert after_plan(PlannerMemory(), plan, now=1.0).budget_level is BudgetLevel.WARN
    stopped = after_stop(PlannerMemory(), now=7.0)
    assert after_stop(stopped, now=8.0).stop_issued_at == 7.0


def test_the_loop_the_simulator_and_the_test_driver_apply_it_and_keep_no_copy() -> None:
    """No caller assigns a memory field by hand any more: each goes through memory.py."""
    fields = {"last_scaling_at", "spot_unavailable_since", "stop_issued_at", "budget_level", "target"}
    callers = [
        "fleetd/reconcile/loop.py",
        "fleetd/reconcile/memory_meta.py",
        "fleetd/sim/fleetd_policy.py",
        "fleetd/sim/fleetd_actions.py",
        "fleetd/sim/fleetd_observe.py",
        "tests/policy_fixtures.py",
    ]
    for rel in callers:
        tree = ast.parse((ROOT / rel).read_text())
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for t in targets:
                name = t.attr if isinstance(t, ast.Attribute) else t.id if isinstance(t, ast.Name) else None
                assert name not in fields, f"{rel}:{node.lineno} assigns {name} by hand"
        # Who takes a plan keeps the memory it returned (``kept_memory``), never recomputes it.
        text = (ROOT / rel).read_text()
        assert "after_plan" not in text, f"{rel} applies the plan to the memory by hand"
        assert "kept_memory" in text or rel.endswith(("fleetd_actions.py", "fleetd_observe.py", "loop.py"))


def test_plan_returns_the_memory_its_plan_leaves() -> None:
    """``plan`` hands back the memory with its plan; a plan made any other way has none to keep."""
    from fleetd.policy.memory import kept_memory, remembered
    from fleetd.policy.observation import Observation
    from fleetd.policy.planner import plan
    from tests.policy_fixtures import config, offer

    obs = Observation(offers=(offer(POOL, 0.4),))
    result = plan(obs, config(), now=100.0)
    assert result.target_nodes is not None
    assert result.memory == after_plan(remembered(obs), result, 100.0)
    assert kept_memory(result).target_nodes == result.target_nodes
    assert kept_memory(result).last_scaling_at == 100.0
    with pytest.raises(ValueError, match="no memory"):
        kept_memory(Plan(target_nodes=2))
