"""The working state of one planner pass, shared by the stages (only plan() creates one)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetd.config import FleetdConfig
from fleetd.policy.deadline import DeadlineCall
from fleetd.policy.model import Action, BudgetLevel, Drain, Node, NodePhase, RequestCheckpoint, Terminate
from fleetd.policy.observation import Observation

# Budget levels from least to most severe: comparing indexes says which is graver.


LEVEL_ORDER = list(BudgetLevel)


@dataclass
class PlanPass:
    """Mutable scratch for one pass; only plan() sees it."""

    obs: Observation
    cfg: FleetdConfig
    now: float
    actions: list[Action] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    billed: list[Node] = field(default_factory=list)  # still costing money after this plan
    kept: list[Node] = field(default_factory=list)  # counted as capacity (not leaving)
    checkpoint_requested: bool = False
    deadline: DeadlineCall | None = None  # the deadline rule's call (stages/deadline.py)
    target_reason: str = ""
    target: int = 0  # the pass's target size, once chosen (step 4)

    def remove(self, node: Node, reason: str) -> None:
        """Take a kept node out of the fleet: drain it if it trains, else terminate it."""
        self.kept.remove(node)
        if node.phase is NodePhase.RUNNING:
            deadline = self.now + self.cfg.rebalance.drain_timeout_s
            self.actions.append(Drain(reason=reason, instance_id=node.instance_id, deadline=deadline))
        else:
            self.billed.remove(node)
            self.actions.append(Terminate(reason=reason, instance_id=node.instance_id))

    def terminate(self, node: Node, reason: str) -> None:
        if node in self.kept:
            self.kept.remove(node)
        if node in self.billed:
            self.billed.remove(node)
        self.actions.append(Terminate(reason=reason, instance_id=node.instance_id))

    def request_checkpoint(self, action: RequestCheckpoint | None, note: str) -> None:
        if action is not None and not self.checkpoint_requested:
            self.actions.append(action)
            self.checkpoint_requested = True
        elif note:
            self.notes.append(note)
