"""The planner's memory between passes (``PlannerMemory``, one frozen value) and how it changes.

``plan`` returns the memory its plan leaves (``Plan.memory``). The reconcile loop, the simulator
and the property-test driver keep it and apply what they executed (a spot launch, a stop) through
the pure functions here, the one place that says how the memory changes, so the simulator predicts
the daemon it models (docs/DESIGN.md "Layers"). Fields: the target and when it last changed, since
when spot is short, the last budget level, when the job's StopJob was first executed.
"""

from __future__ import annotations

from dataclasses import replace

from fleetd.policy.model import Plan, PlannerMemory

__all__ = [
    "PlannerMemory",
    "after_plan",
    "after_spot_launch",
    "after_stop",
    "kept_memory",
    "remembered",
    "with_memory",
]
from fleetd.policy.observation import Observation, spot_shortage_over


def remembered(obs: Observation) -> PlannerMemory:
    """What ``obs`` was given of the memory."""
    return PlannerMemory(
        obs.target_nodes, obs.last_scaling_at, obs.spot_unavailable_since, obs.budget_level, obs.stop_issued_at
    )


def with_memory(result: Plan, obs: Observation, now: float) -> Plan:
    """``result`` carrying the memory once it is taken: how ``planner.plan`` returns it."""
    return replace(result, memory=after_plan(remembered(obs), result, now))


def kept_memory(result: Plan) -> PlannerMemory:
    """The memory a caller keeps after ``result``: the one ``planner.plan`` returned with it."""
    if result.memory is None:
        raise ValueError("the planner returned no memory (Plan.memory: fleetd.policy.memory.with_memory)")
    return result.memory


def after_plan(m: PlannerMemory, plan: Plan, now: float) -> PlannerMemory:
    """The memory once ``plan`` (made at ``now``) is taken."""
    target, scaled_at = m.target_nodes, m.last_scaling_at
    # The first target counts as a change too: the loop has always waited scaling.cooldown_s after
    # sizing the job before its first scaling decision, and the simulator does the same.
    if plan.target_nodes is not None and plan.target_nodes != target:
        target, scaled_at = plan.target_nodes, now
    since = m.spot_unavailable_since
    if plan.spot_short and since is None:
        since = now
    elif spot_shortage_over(plan):
        since = None
    return replace(
        m, target_nodes=target, last_scaling_at=scaled_at, spot_unavailable_since=since, budget_level=plan.budget.level
    )


def after_spot_launch(m: PlannerMemory, got_any: bool, now: float) -> PlannerMemory:
    """A spot launch's outcome: any capacity ends a shortage; none starts one (if none was on)."""
    if got_any:
        return replace(m, spot_unavailable_since=None)
    if m.spot_unavailable_since is None:
        return replace(m, spot_unavailable_since=now)
    return m


def after_stop(m: PlannerMemory, now: float) -> PlannerMemory:
    """A StopJob executed: its first time is the one kept."""
    return m if m.stop_issued_at is not None else replace(m, stop_issued_at=now)
