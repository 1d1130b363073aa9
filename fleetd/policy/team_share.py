"""A job's share of the team, both ways (issue 33; pure):

- ``job_totals``: what each job may have spent in all, from one allocation. The team's money left
  is split in proportion to the burn each job was allotted, on top of what each already spent, so
  the totals add up to the team's total (a per-job cap lowers its own). Every job's daemon stops
  at its own total: the team stays inside its budget even if the arbiter stops and every daemon
  runs on its last share. The allocator already keeps the allotted burn over the horizon inside
  what is left, so a daemon's own forecast (spent + burn over the same horizon) stays under its
  total while the team's total does not bind, and its graded responses start when it does.
- ``within_share``: the job's daemon plans inside its share. Its fleet size and USD/h become at
  most the allotment's, its total the share's; a pause, a job still pending, or no share at all
  (none written yet, or none readable since the daemon started) stops the job through the
  coordinated checkpoint and buys nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fleetd.config import FleetdConfig
from fleetd.policy.team_model import JobCap, TeamActionKind, TeamBudget, TeamPlan

# Allotments under which a job trains nowhere: its daemon stops it (checkpoint first) and buys nothing.
NOT_TRAINING = frozenset({TeamActionKind.PAUSE, TeamActionKind.PAUSED, TeamActionKind.PENDING})


def job_totals(
    plan: TeamPlan, budget: TeamBudget, spent: Mapping[str, float], caps: Mapping[str, JobCap]
) -> dict[str, float]:
    """Job name -> the most it may have spent in all (see the module's docstring)."""
    burns = {a.job: a.usd_per_hour for a in plan.allotments if a.kind not in NOT_TRAINING and a.nodes > 0}
    burning = sum(burns.values())
    left = max(0.0, budget.total_usd - budget.spent_usd)
    out = {}
    for a in plan.allotments:
        share = left * burns[a.job] / burning if a.job in burns and burning > 0 else 0.0
        own = spent.get(a.job, 0.0)
        # Never more than the team's total less what the others spent (exact for a lone job).
        total = min(own + share, budget.total_usd - (budget.spent_usd - own))
        cap = caps.get(a.job)
        if cap is not None and cap.total_usd is not None:
            total = min(total, cap.total_usd)
        out[a.job] = total
    return out


@dataclass(frozen=True, slots=True)
class Share:
    """A job's allotment as its daemon reads it (fleetd/team/allotment_file.py)."""

    kind: TeamActionKind
    nodes: int
    usd_per_hour: float
    total_usd: float
    written_at: float
    reason: str


@dataclass(frozen=True, slots=True)
class Bounded:
    """What the job's planner gets this pass: its config inside the share, whether it trains."""

    cfg: FleetdConfig
    paused: bool
    note: str


def within_share(cfg: FleetdConfig, share: Share | None, now: float) -> Bounded:
    if share is None:
        return Bounded(cfg, True, "no allotment from the team yet: the job waits, nothing is bought")
    age = max(0.0, now - share.written_at)
    said = (
        f"team allotment {share.kind.value}: {share.nodes} node(s), ${share.usd_per_hour:.2f}/h, "
        f"${share.total_usd:.2f} in all ({age:.0f} s old): {share.reason}"
    )
    if share.kind in NOT_TRAINING or share.nodes <= 0 or share.usd_per_hour <= 0 or share.total_usd <= 0:
        return Bounded(cfg, True, said)
    max_nodes = max(1, min(cfg.fleet.max_nodes, share.nodes))
    fleet = cfg.fleet.model_copy(update={"max_nodes": max_nodes, "min_nodes": min(cfg.fleet.min_nodes, max_nodes)})
    budget = cfg.budget.model_copy(
        update={
            "max_usd_per_hour": min(cfg.budget.max_usd_per_hour, share.usd_per_hour),
            "total_usd": min(cfg.budget.total_usd, share.total_usd),
        }
    )
    return Bounded(cfg.model_copy(update={"fleet": fleet, "budget": budget}), False, said)
