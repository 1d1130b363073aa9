"""The planner's vocabulary: what it observes and what it may decide.

Times are seconds on one clock chosen by the caller (epoch seconds in the daemon, virtual seconds
in the simulator). Prices are USD per instance-hour.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Market(StrEnum):
    SPOT = "spot"
    ON_DEMAND = "on-demand"


@dataclass(frozen=True, slots=True, order=True)
class PoolId:
    """A capacity pool: one instance type in one availability zone."""

    instance_type: str
    zone: str

    def __str__(self) -> str:
        return f"{self.instance_type}@{self.zone}"

    @classmethod
    def parse(cls, text: str) -> "PoolId":
        itype, _, zone = text.partition("@")
        if not itype or not zone:
            raise ValueError(f"pool {text!r} is not <instance-type>@<zone>")
        return cls(itype, zone)


@dataclass(frozen=True, slots=True)
class PoolOffer:
    """What a pool offers right now: its hardware and prices (from a price source)."""

    pool: PoolId
    gpus: int
    spot_price: float | None  # None: no spot price known (treat as not offered on spot)
    on_demand_price: float
    gpu_model: str = ""
    gpu_memory_gib: float = 0.0
    spot_price_trend: float = 0.0  # USD/h change per hour over the recent window


class NodePhase(StrEnum):
    PENDING = "pending"  # bought, not yet reporting
    RUNNING = "running"  # reporting / training
    DRAINING = "draining"  # notice or planned removal: checkpoint + upload in progress
    LEAVING = "leaving"  # removed from the rendezvous, process tree stopping
    TERMINATED = "terminated"  # terminal EC2 state, or declared lost by the two-signal rule


@dataclass(frozen=True, slots=True)
class Node:
    instance_id: str
    pool: PoolId
    market: Market
    price_per_hour: float
    launched_at: float
    phase: NodePhase = NodePhase.PENDING
    ec2_state: str = "running"  # pending|running|shutting-down|terminated|stopping|stopped
    last_seen_at: float | None = None  # last MQTT message of any kind
    agent_offline_at: float | None = None  # last will / status offline
    notice_at: float | None = None  # spot interruption notice seen (IMDS or EventBridge)
    notice_deadline: float | None = None  # when AWS will act on the notice
    rebalance_at: float | None = None  # rebalance recommendation seen
    gpu_util_pct: float | None = None
    steps_per_s: float | None = None
    step: int | None = None


@dataclass(frozen=True, slots=True)
class Action:
    """Base of every decision. ``reason`` is logged verbatim: write it for an operator."""

    reason: str


@dataclass(frozen=True, slots=True)
class Launch(Action):
    count: int
    market: Market
    # Ranked candidate pools for one CreateFleet request (diversified over types and zones).
    pools: tuple[PoolId, ...]
    max_price_per_hour: float | None = None
    # The hourly price the planner budgeted for each node (its worst case among `pools`).
    budgeted_price_per_hour: float = 0.0


@dataclass(frozen=True, slots=True)
class Terminate(Action):
    instance_id: str


@dataclass(frozen=True, slots=True)
class RequestCheckpoint(Action):
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class Drain(Action):
    """Checkpoint, upload this node's shard, then remove it from the rendezvous and stop it."""

    instance_id: str
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class MarkPoolUnavailable(Action):
    pool: PoolId
    until: float


@dataclass(frozen=True, slots=True)
class Warn(Action):
    code: str = ""


@dataclass(frozen=True, slots=True)
class StopJob(Action):
    """Coordinated checkpoint, then stop every node cleanly (budget exhausted or job done)."""


@dataclass(frozen=True, slots=True)
class Plan:
    actions: tuple[Action, ...] = ()
    # Decisions that led to no action are still worth a log line ("holding at 3: cool-down").
    notes: tuple[str, ...] = field(default=())
