"""What the planner sees on one pass: plain frozen data assembled by the caller.

The daemon (fleetd/reconcile) builds it from EC2, the intake, the state DB and the price source;
the simulator from its virtual world. Times are on the caller's clock (that of ``plan``'s ``now``);
prices are USD per instance-hour. The planner's memory fields change only through
fleetd/policy/memory.py (docs/DESIGN.md "Layers").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from fleetd.policy.model import BudgetLevel, Launch, Market, Node, Plan, PoolId, PoolOffer


@dataclass(frozen=True, slots=True)
class PoolStats:
    """This fleet's own history with one pool (persisted; see fleetd.policy.ledger.pool_history)."""

    pool: PoolId
    node_hours: float = 0.0
    notices: int = 0  # interruption notices received for nodes in this pool
    losses: int = 0  # nodes lost without a notice (two-signal rule or terminal EC2 state)
    # Unavailable until then after a capacity error (capacity_error_ttl_s), per market: a spot
    # shortage says nothing about on-demand capacity, and the other way round.
    capacity_error_until: float | None = None
    on_demand_capacity_error_until: float | None = None
    last_notice_at: float | None = None  # a recent notice means "interrupting now"
    # Prior from the Spot Advisor bucket table (fleetd.policy.placement.prior_rate_for_bucket).
    prior_interruptions_per_hour: float | None = None


class DesiredJob(StrEnum):
    RUN = "run"
    STOP = "stop"  # the operator (or the budget) asked to stop: checkpoint, then stop every node
    END = "end"  # the job is over (succeeded or failed): no trainer is left; release every node now


@dataclass(frozen=True, slots=True)
class Observation:
    nodes: tuple[Node, ...] = ()
    offers: tuple[PoolOffer, ...] = ()
    pool_stats: tuple[PoolStats, ...] = ()
    # Ledger snapshot: everything accrued so far, 60 s minimum charges of launches included.
    spent_usd: float = 0.0
    # Telemetry aggregates: measured training steps/s keyed by the number of training NODES.
    throughput_by_nodes: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))
    # Last checkpoint whose manifest is in S3 (durable), and the last checkpoint we asked for.
    last_durable_checkpoint_step: int | None = None
    last_durable_checkpoint_at: float | None = None
    last_checkpoint_request_at: float | None = None
    # The planner's memory (fleetd/policy/memory.py); rebalance_prebuys_last_hour: Launches with
    # purpose rebalance-prebuy executed in the last hour (the churn cap).
    target_nodes: int | None = None
    last_scaling_at: float | None = None
    rebalance_prebuys_last_hour: int = 0
    spot_unavailable_since: float | None = None
    desired_job: DesiredJob = DesiredJob.RUN
    stop_issued_at: float | None = None
    # When the stop's sequence ended cleanly (checkpoint durable, every agent told to shut down:
    # fleetd/rendezvous/commander.py); nothing is left to save, the nodes may go at once.
    stop_completed_at: float | None = None
    # The previous plan's Plan.budget.level: a Warn is emitted when the level rises, not every pass.
    budget_level: BudgetLevel = BudgetLevel.NORMAL
    # When the job first ran (set once, kept): the start of a deadline job's progress line;
    # None: the earliest node's launch, else now.
    job_started_at: float | None = None
    # The job's code version now (a submitted job file's digest); "" when nodes run baked code.
    code_digest: str = ""

    def stats_by_pool(self) -> dict[PoolId, PoolStats]:
        return {s.pool: s for s in self.pool_stats}

    def offers_by_pool(self) -> dict[PoolId, PoolOffer]:
        return {o.pool: o for o in self.offers}


def spot_shortage_over(plan: Plan) -> bool:
    """Whether ``plan`` ends a remembered spot shortage (``spot_unavailable_since``): it reports
    none (the need went away, nodes came back) and tries no spot launch. A planned spot launch
    decides by its outcome instead (success clears, total failure keeps it), so a pool whose
    capacity-error TTL ran out does not restart the on-demand fallback's wait each time it is
    retried in vain. Without this, a stale value makes the NEXT shortage skip spot_wait_s."""
    return not plan.spot_short and not any(isinstance(a, Launch) and a.market is Market.SPOT for a in plan.actions)
