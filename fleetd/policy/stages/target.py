"""Step 4: the scaling target (bounded by the budget level) and replacing a straggler."""

from __future__ import annotations

from fleetd.policy import budget as budget_policy
from fleetd.policy.model import BudgetLevel, Drain, NodePhase
from fleetd.policy.scaling import decide_target, stragglers
from fleetd.policy.stages.buying import spot_pools
from fleetd.policy.stages.pass_state import PlanPass


def choose_target(p: PlanPass, level: BudgetLevel) -> int:
    obs, cfg = p.obs, p.cfg
    training = [n for n in p.kept if n.phase is NodePhase.RUNNING]
    any_leaving = any(n.leaving for n in p.billed) or any(isinstance(a, Drain) for a in p.actions)
    cheapest = None
    ranked, _ = spot_pools(p)
    if ranked:
        cheapest = ranked[0].price_per_hour
    decision = decide_target(
        up_blocked_by_budget=_scale_up_would_warn(p, cheapest),
        previous=obs.target_nodes,
        training=training,
        throughput_by_nodes=obs.throughput_by_nodes,
        budget_level=level,
        any_leaving=any_leaving,
        next_node_price=cheapest,
        last_scaling_at=obs.last_scaling_at,
        cfg=cfg,
        now=p.now,
    )
    p.notes.append(decision.reason)
    p.target_reason = decision.reason
    if (
        level is BudgetLevel.NORMAL
        and not any_leaving
        and decision.target == obs.target_nodes
        and len(p.kept) >= decision.target
    ):
        slow = stragglers(training, cfg.scaling.straggler_ratio, now=p.now, settle_s=cfg.scaling.straggler_settle_s)
        if slow:
            node, reason = slow[0]
            # Replacing it needs room for one more node at its price (the drain frees it later).
            room = budget_policy.headroom(obs.spent_usd, p.billed, p.kept, cfg)
            if len(p.kept) > cfg.fleet.min_nodes or room.affordable(
                node.price_per_hour, node.worst_case_price_per_hour
            ):
                p.remove(node, reason)
            else:
                p.notes.append(f"{reason}: not now, no budget room for its replacement")
    return decision.target


def _scale_up_would_warn(p: PlanPass, price: float | None) -> str:
    """Budget hysteresis: a scale-up must not by itself push the forecast to warn_at, or the
    fleet would grow and shrink in turns."""
    if price is None:
        return ""
    b = p.cfg.budget
    burn = budget_policy.burn_usd_per_hour(p.kept) + price
    share = (p.obs.spent_usd + burn * b.forecast_horizon_s / 3600.0) / b.total_usd
    if share >= b.warn_at:
        return f"one more node (${price:.3f}/h) would bring the forecast to {share:.0%} >= warn_at {b.warn_at:.0%}"
    return ""
