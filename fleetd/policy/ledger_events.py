"""The ledger's events (fleetd/policy/ledger.py computes spend and goodput from them): what was
bought, where EC2 placed it, when it stopped, prices, the trainers' progress, scaling decisions.
Each is persisted as one row (fleetd/reconcile/ledger_store.py) under its kind in EVENT_TYPES."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

from fleetd.policy.model import Market, PoolId


@dataclass(frozen=True, slots=True)
class InstanceStarted:
    at: float
    instance_id: str
    pool: PoolId
    market: Market
    price_per_hour: float  # price in force at launch
    on_demand_price_per_hour: float  # for the on-demand equivalent
    event_id: str = ""  # de-duplication key in the store ("" = none)


@dataclass(frozen=True, slots=True)
class InstancePlaced:
    """EC2 says the instance runs in ``pool`` (DescribeInstances' Placement). A launch reply can
    name another zone than the one EC2 chose (it names the override it asked for; moto places
    where it likes): this event makes the instance's whole bill, and every report's pool label,
    follow EC2's answer, at the prices in force for that pool at its launch."""

    at: float
    instance_id: str
    pool: PoolId
    price_per_hour: float
    on_demand_price_per_hour: float
    event_id: str = ""


@dataclass(frozen=True, slots=True)
class InstanceStopped:
    at: float
    instance_id: str
    event_id: str = ""


@dataclass(frozen=True, slots=True)
class PriceChanged:
    """The price of ``pool`` on ``market`` is ``price_per_hour`` from ``at`` on."""

    at: float
    pool: PoolId
    market: Market
    price_per_hour: float
    event_id: str = ""


@dataclass(frozen=True, slots=True)
class StepReached:
    """Training completed ``step`` (the highest step so far of the current attempt)."""

    at: float
    step: int
    event_id: str = ""


@dataclass(frozen=True, slots=True)
class StepsLost:
    """Training went back from ``from_step`` to ``to_step`` (the checkpoint it resumed from)."""

    at: float
    from_step: int
    to_step: int
    event_id: str = ""


@dataclass(frozen=True, slots=True)
class StepsRegained:
    """A world resumed at a newer copy than the one the job had dropped to (a stale world, which
    restored an older checkpoint, replaced by one that holds the high-water mark): ``steps`` that
    an earlier ``StepsLost`` counted were never trained again. Only the steps the stale world
    trained twice stay lost."""

    at: float
    steps: int
    event_id: str = ""


@dataclass(frozen=True, slots=True)
class RecoveryTime:
    """``seconds`` from losing a node to every survivor training again."""

    at: float
    seconds: float
    event_id: str = ""


@dataclass(frozen=True, slots=True)
class IdleGpuTime:
    at: float
    instance_id: str
    gpu_seconds: float
    event_id: str = ""


@dataclass(frozen=True, slots=True)
class Interruption:
    """For pool statistics: a notice, or a loss without one (two-signal rule / terminal state)."""

    at: float
    instance_id: str
    pool: PoolId
    kind: Literal["notice", "loss"]
    event_id: str = ""


@dataclass(frozen=True, slots=True)
class TargetChanged:
    """The planner changed the fleet's target node count, and why (kept for the report)."""

    at: float
    previous: int
    target: int
    reason: str
    event_id: str = ""


@dataclass(frozen=True, slots=True)
class BillsRolledUp:
    """Instances that ended before ``at`` (ledger compaction, fleetd.policy.ledger_compact):
    their bills summed, exactly as ``bills`` computed them, in place of their per-instance rows
    (start, placement, stop, interruption, idle time)."""

    at: float
    instances: int
    billed_seconds: float
    usd: float
    on_demand_usd: float
    usd_by_market: dict[str, float]
    usd_by_pool: dict[str, float]
    idle_gpu_s: float
    notices: int
    losses: int
    event_id: str = ""


@dataclass(frozen=True, slots=True)
class JobStateChanged:
    """The job moved to ``state`` (fleetd/policy/job_state.py): the ledger's record of its life
    beside its dollars, so a report read from the ledger alone says how the job ended. Not
    billing: spend and goodput ignore it, and compaction keeps every one."""

    at: float
    state: str
    reason: str
    restarts: int = 0
    step: int | None = None  # the job's last step when it ended (None while it runs, or unknown)
    code_digest: str = ""
    event_id: str = ""


LedgerEvent: TypeAlias = (
    InstanceStarted
    | InstancePlaced
    | TargetChanged
    | InstanceStopped
    | PriceChanged
    | StepReached
    | StepsLost
    | StepsRegained
    | RecoveryTime
    | IdleGpuTime
    | Interruption
    | BillsRolledUp
    | JobStateChanged
)
EVENT_TYPES: dict[str, type[LedgerEvent]] = {
    "instance-started": InstanceStarted,
    "instance-stopped": InstanceStopped,
    "price-changed": PriceChanged,
    "step-reached": StepReached,
    "steps-lost": StepsLost,
    "steps-regained": StepsRegained,
    "recovery-time": RecoveryTime,
    "idle-gpu-time": IdleGpuTime,
    "interruption": Interruption,
    "instance-placed": InstancePlaced,
    "target-changed": TargetChanged,
    "bills-rolled-up": BillsRolledUp,
    "job-state": JobStateChanged,
}
EVENT_KINDS: dict[type[LedgerEvent], str] = {v: k for k, v in EVENT_TYPES.items()}
