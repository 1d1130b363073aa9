"""What one simulated run of one policy produced: costs, effective time, losses, a timeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    nodes: int
    spent_usd: float
    progress: float  # share of the job's work


@dataclass
class SimResult:
    policy: str
    trace: str
    cost_usd: float
    on_demand_cost_usd: float  # the same paid node-time at on-demand prices
    paid_node_s: float
    useful_node_s: float
    effective_time: float
    steps_done: float
    steps_lost: float
    total_steps: float
    completed: bool
    finished_at_s: float | None
    deadline_s: float | None
    deadline_met: bool | None
    notices: int
    losses_without_notice: int
    overhead_node_s: dict[str, float]
    on_demand_node_s: float
    # The overhead by reason and cause ("re-form: join", "checkpoint: before a leave"); sums to
    # ``overhead_node_s`` reason by reason.
    breakdown_node_s: dict[str, float] = field(default_factory=dict)
    actions: list[str] = field(default_factory=list)
    timeline: list[Sample] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "trace": self.trace,
            "cost_usd": round(self.cost_usd, 4),
            "on_demand_cost_usd": round(self.on_demand_cost_usd, 4),
            "savings_pct": round(100.0 * (1 - self.cost_usd / self.on_demand_cost_usd), 2)
            if self.on_demand_cost_usd > 0
            else None,
            "effective_time": round(self.effective_time, 4),
            "paid_node_hours": round(self.paid_node_s / 3600.0, 3),
            "useful_node_hours": round(self.useful_node_s / 3600.0, 3),
            "on_demand_node_hours": round(self.on_demand_node_s / 3600.0, 3),
            "steps_done": round(self.steps_done, 1),
            "usd_per_1k_steps": round(1000.0 * self.cost_usd / self.steps_done, 4) if self.steps_done > 0 else None,
            "steps_lost": round(self.steps_lost, 1),
            "progress": round(self.steps_done / self.total_steps, 4),
            "completed": self.completed,
            "finished_at_h": None if self.finished_at_s is None else round(self.finished_at_s / 3600.0, 3),
            "deadline_h": None if self.deadline_s is None else round(self.deadline_s / 3600.0, 3),
            "deadline_met": self.deadline_met,
            "notices": self.notices,
            "losses_without_notice": self.losses_without_notice,
            "overhead_node_hours": {k: round(v / 3600.0, 3) for k, v in sorted(self.overhead_node_s.items())},
            "overhead_breakdown_node_hours": {
                k: round(v / 3600.0, 3) for k, v in sorted(self.breakdown_node_s.items())
            },
        }
