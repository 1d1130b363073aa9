"""Step 4: fit the kept fleet to the target: remove the excess, shed burn above the cap, and move
on-demand nodes back to spot (make-before-break)."""

from __future__ import annotations

from dataclasses import dataclass

from fleetd.policy import budget as budget_policy
from fleetd.policy import rebalance as rebalance_policy
from fleetd.policy.model import BudgetLevel, Market, Node, NodePhase, RequestCheckpoint
from fleetd.policy.stages.pass_state import PlanPass


@dataclass(frozen=True, slots=True)
class Sizing:
    """What fitting the fleet leaves for the buying stage."""

    counted: int  # kept nodes that count toward the target
    # Spot nodes to launch now to replace on-demand ones (back to spot, make-before-break).
    buy_spot_for_on_demand: int


def size_fleet(
    p: PlanPass, target: int, risk: rebalance_policy.RiskPlan, spot_available: bool, level: BudgetLevel
) -> Sizing:
    """Remove what is beyond the target, shed burn above the cap, and move off on-demand.

    Nodes beyond the target are not excess when they cover an at-risk node (a pre-buy), or when
    they are spot nodes bought to replace on-demand nodes (back to spot). Back to spot moves
    every on-demand node at once: one launch for all of them, then one drain of all of them in
    one pass, so the fleet re-forms twice in all rather than twice per on-demand node (each
    re-form stalls every rank for a checkpoint and a rendezvous round).
    """
    extras = max(0, len(p.kept) - target - risk.covered)
    on_demand = [n for n in p.kept if n.market is Market.ON_DEMAND]
    # A deadline keeps its on-demand nodes until the job is well ahead (deadline.py hysteresis).
    deadline_holds = p.deadline is not None and not (p.deadline.on_demand_not_needed or p.deadline.swap_to_spot)
    back_to_spot = bool(on_demand) and spot_available and level is not BudgetLevel.SHRINK and not deadline_holds
    if on_demand:
        _release_on_demand(p, on_demand, target)
        on_demand = [n for n in p.kept if n.market is Market.ON_DEMAND]
        back_to_spot = back_to_spot and bool(on_demand)
    replacements = min(len(on_demand), extras) if back_to_spot else 0
    counted = len(p.kept) - risk.covered - replacements
    if counted > target:
        _remove_excess(p, counted - target, target, risk.at_risk, risk.release)
    _shed_burn(p)
    on_demand = [n for n in p.kept if n.market is Market.ON_DEMAND]  # after removals
    if replacements and on_demand:
        replacements -= _return_to_spot(p, on_demand, min(replacements, len(on_demand)))
    still_on_demand = sum(1 for n in p.kept if n.market is Market.ON_DEMAND)
    replacements = min(replacements, still_on_demand)  # a replacement with nothing to replace counts
    return Sizing(
        counted=len(p.kept) - risk.covered - replacements,
        buy_spot_for_on_demand=max(0, still_on_demand - replacements) if back_to_spot else 0,
    )


def _release_on_demand(p: PlanPass, on_demand: list[Node], target: int) -> None:
    """Well ahead of the deadline's line: on-demand nodes are not needed, unless the config holds
    the fleet size with them. They go now, break-before-make as in Uniform Progress (one node
    idles until spot returns): with the lead, paying them while spot replacements boot would buy
    time the deadline does not need. A fleet keeps the on-demand nodes that, with the spot nodes
    training, still hold the line's pace in whole nodes (``on_demand_keep``); those go back to
    spot make-before-break once spot is offered. Releasing them all with no spot to take their place
    bought them back every cycle: on the reclaim-wave trace (bench/deadline.py, a pool that
    never refills) that churn cost an 8-node job more than on-demand alone."""
    call = p.deadline
    if call is None or not call.on_demand_not_needed or p.cfg.capacity.on_demand == "hold_size":
        return
    keep = call.on_demand_keep if target > 1 else 0
    # Not yet training first, then the priciest: the cheapest training ones are kept.
    order = sorted(on_demand, key=lambda n: (n.phase is NodePhase.RUNNING, -n.price_per_hour, n.instance_id))
    for node in order[: max(0, len(on_demand) - keep)]:
        if node.phase is NodePhase.RUNNING or node.phase is NodePhase.PENDING:
            p.remove(
                node,
                f"{call.reason}: on-demand {node.instance_id} (${node.price_per_hour:.3f}/h) is not "
                "needed; waiting for spot",
            )


def _removal_order(nodes: list[Node], at_risk: tuple[Node, ...], release: frozenset[str] = frozenset()) -> list[Node]:
    """Cheapest to lose first: not yet training, on-demand, pre-bought for an expired
    recommendation, at risk, most expensive, newest."""
    risky = {n.instance_id for n in at_risk}
    return sorted(
        nodes,
        key=lambda n: (
            n.phase is NodePhase.RUNNING,
            n.market is not Market.ON_DEMAND,
            n.instance_id not in release,
            n.instance_id not in risky,
            -n.price_per_hour,
            -n.launched_at,
            n.instance_id,
        ),
    )


def _remove_excess(
    p: PlanPass, excess: int, target: int, at_risk: tuple[Node, ...], release: frozenset[str] = frozenset()
) -> None:
    for node in _removal_order(p.kept, at_risk, release)[:excess]:
        why = " (pre-bought for a rebalance recommendation that expired)" if node.instance_id in release else ""
        p.remove(
            node,
            f"scaling to {target} nodes: removing {node.instance_id} ({node.market.value} "
            f"${node.price_per_hour:.3f}/h, {node.phase.value}){why}",
        )


def _shed_burn(p: PlanPass) -> None:
    """Prices rose since the last pass: shed the priciest nodes until the burn fits again."""
    cap = p.cfg.budget.max_usd_per_hour
    while budget_policy.burn_usd_per_hour(p.kept) > cap + 1e-9 and len(p.kept) > p.cfg.fleet.min_nodes:
        burn = budget_policy.burn_usd_per_hour(p.kept)
        node = max(p.kept, key=lambda n: (n.price_per_hour, n.instance_id))
        p.remove(
            node,
            f"burn ${burn:.2f}/h exceeds max_usd_per_hour ${cap:.2f}: removing "
            f"{node.instance_id} (${node.price_per_hour:.3f}/h)",
        )


def _return_to_spot(p: PlanPass, on_demand: list[Node], replacements: int) -> int:
    """Spot nodes beyond the target exist: once they all train and a checkpoint taken after the
    last of them joined is durable, drain as many on-demand nodes as there are spot nodes to
    take their place, priciest first, in this one pass (make-before-break, never mid-step).
    Returns how many were drained."""
    spot_running = [n for n in p.kept if n.market is Market.SPOT and n.phase is NodePhase.RUNNING]
    spot_pending = [n for n in p.kept if n.market is Market.SPOT and n.phase is NodePhase.PENDING]
    if not spot_running or spot_pending:
        p.notes.append("back to spot: waiting for the new spot node to join training")
        return 0
    joined = max(n.running_since if n.running_since is not None else n.launched_at for n in spot_running)
    durable = p.obs.last_durable_checkpoint_at
    victims = sorted(on_demand, key=lambda n: (-n.price_per_hour, n.instance_id))[:replacements]
    if durable is not None and durable >= joined:
        for victim in victims:
            p.remove(
                victim,
                f"back to spot: spot capacity is training again and checkpoint step "
                f"{p.obs.last_durable_checkpoint_step} is durable ({p.now - durable:.0f} s ago): "
                f"draining on-demand {victim.instance_id} (${victim.price_per_hour:.3f}/h)"
                + (f", one of {len(victims)} leaving together" if len(victims) > 1 else ""),
            )
        return len(victims)
    names = ", ".join(v.instance_id for v in victims)
    waiting = f"back to spot: draining on-demand {names} after the next durable checkpoint"
    requested = p.obs.last_checkpoint_request_at
    if requested is not None and requested >= joined and p.now - requested < p.cfg.rebalance.checkpoint_retry_s:
        p.notes.append(f"{waiting}; checkpoint requested {p.now - requested:.0f} s ago")
        return 0
    p.request_checkpoint(RequestCheckpoint(reason=f"{waiting}: none is durable since the spot node joined"), "")
    return 0
