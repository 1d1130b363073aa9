"""The state DB's row types and states (fleetd/reconcile/state.py): plain data the store returns
and the observe step hands it, kept apart so readers of a row need not import the store."""

from __future__ import annotations

from dataclasses import dataclass

from fleetd.policy.model import Market, PoolId

OPEN = "intent"
LAUNCHED = "launched"
FAILED = "failed"
ABANDONED = "abandoned"


@dataclass(frozen=True, slots=True)
class LaunchRow:
    token: str
    seq: int
    planned_at: float
    count: int
    market: Market
    pools: tuple[PoolId, ...]
    purpose: str
    max_price_per_hour: float | None
    status: str
    instance_ids: tuple[str, ...]
    settled_at: float | None


@dataclass(frozen=True, slots=True)
class InstanceRow:
    instance_id: str
    pool: PoolId
    market: Market
    price_per_hour: float
    max_price_per_hour: float | None
    launched_at: float
    launch_token: str | None
    ec2_state: str
    first_seen_at: float
    notice_at: float | None
    drain_started_at: float | None
    terminate_requested_at: float | None
    ended_at: float | None
    end_reason: str | None

    @property
    def open(self) -> bool:
        return self.ended_at is None


@dataclass(frozen=True, slots=True)
class DrainRecord:
    """A drain the controller decided (fleetd.reconcile.journal)."""

    instance_id: str
    started_at: float
    deadline: float | None
    reason: str
    sent_at: float | None


@dataclass(frozen=True, slots=True)
class PoolStatsRow:
    pool: PoolId
    node_hours: float
    notices: int
    losses: int
    capacity_errors: int
    capacity_error_until: float | None
    last_error_code: str | None
    last_notice_at: float | None
    on_demand_capacity_error_until: float | None = None


@dataclass(frozen=True, slots=True)
class SeenInstance:
    """What the loop observed of one instance on EC2 this pass."""

    instance_id: str
    pool: PoolId
    market: Market
    ec2_state: str
    launched_at: float
    launch_token: str | None
    price_per_hour: float  # price now, used when fleetd sees the instance for the first time
    state_reason: str = ""
    ended_at: float | None = None  # EC2's transition time out of running (Ec2Instance.ended_at)


@dataclass(frozen=True, slots=True)
class SyncReport:
    adopted: tuple[str, ...] = ()  # running instances fleetd had no record of
    ended: tuple[tuple[str, str], ...] = ()  # (instance_id, end_reason)


TERMINAL = ("shutting-down", "terminated")
