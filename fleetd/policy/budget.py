"""Budget: graded level from the spend forecast, and the gate every launch must pass.

Two caps (DESIGN.md, "Budget semantics"):
- ``budget.total_usd`` (hard): the planner keeps going only while the spend committed until the next
  decision plus a clean stop fits: spent + worst-case price of every billed node over
  (reconcile interval + stop reserve) + each launch's cost over max(60 s minimum, that window).
  Spot nodes are committed at their bid (AWS reclaims them above it), so a price spike between two
  passes cannot push spend past the cap.
- ``budget.max_usd_per_hour``: the burn of the nodes we keep (current prices, nodes already leaving
  excluded) plus each launch at its budgeted price never exceeds the cap after a plan.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fleetd.config import FleetdConfig
from fleetd.policy.ledger import charge
from fleetd.policy.model import BudgetLevel, BudgetStatus, Launch, Node


def commit_window_s(cfg: FleetdConfig) -> float:
    """How long a decision binds us: until the next pass, plus a clean stop after it."""
    return cfg.fleet.reconcile_interval_s + cfg.budget.stop_reserve_s


def node_commitment_usd(nodes: Iterable[Node], window_s: float) -> float:
    return sum(n.worst_case_price_per_hour for n in nodes) * window_s / 3600.0


def launch_commitment_usd(count: int, worst_price_per_hour: float, window_s: float) -> float:
    """``count`` launches held for ``window_s``, each billed as the ledger bills it (its minimum included)."""
    return count * charge(0.0, window_s, worst_price_per_hour).usd


def burn_usd_per_hour(kept: Iterable[Node]) -> float:
    return sum(n.price_per_hour for n in kept)


@dataclass(frozen=True, slots=True)
class BudgetView:
    """The budget at the start of a pass, before this pass's actions."""

    level: BudgetLevel
    spent_usd: float
    burn_usd_per_hour: float
    forecast_usd: float
    committed_usd: float
    reason: str
    total_usd: float

    def status(self, burn_after: float, committed_after: float) -> BudgetStatus:
        left = max(0.0, self.total_usd - self.spent_usd)
        return BudgetStatus(
            level=self.level,
            spent_usd=self.spent_usd,
            burn_usd_per_hour=burn_after,
            forecast_usd=self.forecast_usd,
            committed_usd=committed_after,
            runway_h=(left / burn_after) if burn_after > 0 else None,
            reason=self.reason,
        )


def assess(spent_usd: float, billed: list[Node], kept: list[Node], cfg: FleetdConfig) -> BudgetView:
    """Graded level. ``billed``: every node still costing money; ``kept``: those not leaving."""
    b = cfg.budget
    burn = burn_usd_per_hour(kept)
    forecast = spent_usd + burn * b.forecast_horizon_s / 3600.0
    committed = spent_usd + node_commitment_usd(billed, commit_window_s(cfg))
    share = forecast / b.total_usd
    runway = f"; the budget lasts {max(0.0, b.total_usd - spent_usd) / burn:.1f} h at this burn" if burn > 0 else ""
    money = (
        f"spent ${spent_usd:.2f} of ${b.total_usd:.2f}; burn ${burn:.2f}/h; "
        f"forecast ${forecast:.2f} ({share:.0%}) over the next {b.forecast_horizon_s / 3600:g} h"
        f"{runway}"
    )
    if committed >= b.total_usd:
        level = BudgetLevel.STOP
        why = (
            f"budget cap reached: committed ${committed:.2f} (spent plus the next "
            f"{commit_window_s(cfg):.0f} s worst case) would cross ${b.total_usd:.2f}; {money}"
        )
    elif share >= b.shrink_at:
        level = BudgetLevel.SHRINK
        why = f"forecast at {share:.0%} >= shrink_at {b.shrink_at:.0%}: shrinking; {money}"
    elif share >= b.forbid_on_demand_at:
        level = BudgetLevel.FORBID_ON_DEMAND
        why = (
            f"forecast at {share:.0%} >= forbid_on_demand_at {b.forbid_on_demand_at:.0%}: "
            f"no on-demand launches; {money}"
        )
    elif share >= b.warn_at:
        level = BudgetLevel.WARN
        why = f"forecast at {share:.0%} >= warn_at {b.warn_at:.0%}; {money}"
    else:
        level = BudgetLevel.NORMAL
        why = money
    return BudgetView(level, spent_usd, burn, forecast, committed, why, b.total_usd)


@dataclass(frozen=True, slots=True)
class Headroom:
    """What is left under both caps once the nodes we keep are accounted for."""

    usd_per_hour: float  # burn-rate room
    usd: float  # total-cap room over the commitment window
    window_s: float

    def affordable(self, price_now: float, worst_price: float) -> int:
        """How many nodes at these prices fit under both caps (never negative)."""
        by_rate = self.usd_per_hour / price_now if price_now > 0 else float("inf")
        per_node = launch_commitment_usd(1, worst_price, self.window_s)
        by_total = self.usd / per_node if per_node > 0 else float("inf")
        # A hair of tolerance so that exactly-at-cap (from float sums) still fits.
        n = min(by_rate, by_total) + 1e-9
        return max(0, int(n)) if n != float("inf") else 1 << 30

    def after(self, launch: Launch) -> Headroom:
        return Headroom(
            self.usd_per_hour - launch.count * launch.budgeted_price_per_hour,
            self.usd - launch_commitment_usd(launch.count, launch.worst_case_price_per_hour, self.window_s),
            self.window_s,
        )

    def explain(self) -> str:
        return (
            f"${max(self.usd_per_hour, 0):.2f}/h left under max_usd_per_hour, "
            f"${max(self.usd, 0):.2f} left under total_usd for the next {self.window_s:.0f} s"
        )


def headroom(spent_usd: float, billed: list[Node], kept: list[Node], cfg: FleetdConfig) -> Headroom:
    window = commit_window_s(cfg)
    return Headroom(
        usd_per_hour=cfg.budget.max_usd_per_hour - burn_usd_per_hour(kept),
        usd=cfg.budget.total_usd - spent_usd - node_commitment_usd(billed, window),
        window_s=window,
    )
