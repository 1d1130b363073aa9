"""The pass's Plan: its actions and notes, the target, and the budget status after the actions."""

from __future__ import annotations

from fleetd.policy import budget as budget_policy
from fleetd.policy.model import Launch, Plan
from fleetd.policy.stages.pass_state import PlanPass


def assemble_plan(p: PlanPass, view: budget_policy.BudgetView, target: int, spot_short: bool = False) -> Plan:
    launches = [a for a in p.actions if isinstance(a, Launch)]
    burn_after = budget_policy.burn_usd_per_hour(p.kept) + sum(a.count * a.budgeted_price_per_hour for a in launches)
    window = budget_policy.commit_window_s(p.cfg)
    committed = (
        p.obs.spent_usd
        + budget_policy.node_commitment_usd(p.billed, window)
        + sum(budget_policy.launch_commitment_usd(a.count, a.worst_case_price_per_hour, window) for a in launches)
    )
    if not p.actions:
        p.notes.append(f"no action: {view.reason}")
    return Plan(
        actions=tuple(p.actions),
        notes=tuple(p.notes),
        target_nodes=target,
        target_reason=p.target_reason,
        budget=view.status(burn_after, committed),
        spot_short=spot_short,
        deadline=p.deadline,
    )
