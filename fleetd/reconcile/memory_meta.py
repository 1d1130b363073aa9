"""The planner's memory (fleetd/policy/memory.py) kept as meta in the state store between passes:
each field under its own key, written only when the pass changed it; the target's change is also
a ledger event (with its reason, for `fleetd report`). A dry run writes nothing."""

from __future__ import annotations

from fleetd.policy.memory import PlannerMemory, after_plan
from fleetd.policy.model import Plan
from fleetd.policy.observation import Observation
from fleetd.reconcile.ledger_feed import LedgerFeed
from fleetd.reconcile.state_port import StateBackend
from fleetd.shared.logs import get_logger

log = get_logger(__name__)


async def remember(
    state: StateBackend, feed: LedgerFeed | None, obs: Observation, plan: Plan, now: float, *, dry_run: bool
) -> None:
    before = PlannerMemory.of(obs)
    after = after_plan(before, plan, now)
    if after.target_nodes is not None and after.target_nodes != before.target_nodes:
        log.info("target_changed", previous=obs.target_nodes, target=plan.target_nodes, reason=plan.target_reason)
        if not dry_run:
            await state.set_meta("target_nodes", after.target_nodes)
            await state.set_meta("last_scaling_at", after.last_scaling_at)
            if feed is not None and obs.target_nodes is not None:
                # Kept with its reason for `fleetd report` (the first target is no decision).
                await feed.target_changed(now, obs.target_nodes, after.target_nodes, plan.target_reason)
    if dry_run:
        return
    if after.budget_level is not before.budget_level:
        await state.set_meta("budget_level", after.budget_level.value)
    if after.spot_unavailable_since == before.spot_unavailable_since:
        return
    await state.set_meta("spot_unavailable_since", after.spot_unavailable_since)
    if after.spot_unavailable_since is not None:
        log.warning("spot_unavailable", why="no spot pool available for a needed launch")
    elif before.spot_unavailable_since is not None:
        # The shortage ended without a spot launch succeeding (the need went away, nodes came
        # back): forgotten, or the next shortage would skip capacity.spot_wait_s.
        log.info(
            "spot_available_again",
            unavailable_for_s=now - before.spot_unavailable_since,
            why="no spot shortage in the plan",
        )
