"""The planner's memory (fleetd/policy/memory.py) kept in the state store between passes, loaded
and stored as one value by this module only. Each field sits under its own meta key, written only
when it changed: the format every state DB and DynamoDB table of an earlier release already has,
so an upgraded controller reads its memory without a migration. The target's change is also a
ledger event (with its reason, for `fleetd report`). A dry run writes nothing."""

from __future__ import annotations

from fleetd.policy.memory import kept_memory, remembered
from fleetd.policy.model import BudgetLevel, Plan, PlannerMemory
from fleetd.policy.observation import Observation
from fleetd.reconcile.ledger_feed import LedgerFeed
from fleetd.reconcile.state_port import StateBackend
from fleetd.shared.logs import get_logger

log = get_logger(__name__)


async def load_memory(state: StateBackend) -> PlannerMemory:
    return PlannerMemory(
        target_nodes=await state.get_meta("target_nodes"),
        last_scaling_at=await state.get_meta("last_scaling_at"),
        spot_unavailable_since=await state.get_meta("spot_unavailable_since"),
        budget_level=BudgetLevel(await state.get_meta("budget_level", BudgetLevel.NORMAL.value)),
        stop_issued_at=await state.get_meta("stop_issued_at"),
    )


async def store_memory(state: StateBackend, before: PlannerMemory, after: PlannerMemory) -> None:
    """Write the fields ``after`` changed from ``before``."""
    for name in PlannerMemory.__slots__:
        value = getattr(after, name)
        if value != getattr(before, name):
            await state.set_meta(name, value.value if isinstance(value, BudgetLevel) else value)


async def remember(
    state: StateBackend, feed: LedgerFeed | None, obs: Observation, plan: Plan, now: float, *, dry_run: bool
) -> None:
    before, after = remembered(obs), kept_memory(plan)
    aim = after.target_nodes
    retargeted = aim is not None and aim != before.target_nodes
    if retargeted:
        log.info("target_changed", previous=obs.target_nodes, target=plan.target_nodes, reason=plan.target_reason)
    if dry_run:
        return
    await store_memory(state, before, after)
    if retargeted and aim is not None and feed is not None and obs.target_nodes is not None:
        # Kept with its reason for `fleetd report` (the first target is no decision).
        await feed.target_changed(now, obs.target_nodes, aim, plan.target_reason)
    if after.spot_unavailable_since == before.spot_unavailable_since:
        return
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
