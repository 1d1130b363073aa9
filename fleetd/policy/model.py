"""The planner's vocabulary: what it observes and what it may decide.

Times are seconds on one clock chosen by the caller (epoch seconds in the daemon, virtual seconds
in the simulator). Prices are USD per instance-hour.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import TypeVar

from fleetd.policy.deadline import DeadlineCall


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
    def parse(cls, text: str) -> PoolId:
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
    relative_throughput: float = 1.0  # training throughput of one of its GPUs relative to one A10G (catalog)
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
    # fleetd last saw this node's torchrun keep-alive advance in the rendezvous store: liveness
    # over a second connection, independent of the broker (policy/lifecycle.py).
    store_seen_at: float | None = None
    notice_at: float | None = None  # spot interruption notice seen (IMDS or EventBridge)
    notice_deadline: float | None = None  # when AWS will act on the notice
    rebalance_at: float | None = None  # rebalance recommendation seen
    gpu_util_pct: float | None = None  # smoothed over the agent's reports (registry)
    cpu_pct: float | None = None  # host CPU, smoothed: with idle GPUs it says "input-bound"
    steps_per_s: float | None = None  # the latest report
    steps_per_s_avg: float | None = None  # smoothed over the reports (registry): judges stragglers
    step: int | None = None
    # The most this node can cost per hour: its spot bid (AWS reclaims it above that), or its
    # on-demand price. The hard budget cap is committed at this price; None: price_per_hour.
    max_price_per_hour: float | None = None
    running_since: float | None = None  # joined training (first telemetry with a step)
    drain_started_at: float | None = None  # when a Drain was sent (planned or on notice)
    # When the node's agent reported that its trainer exited (TrainerExited, or status
    # "leaving"): after a drain or notice, its checkpoint shard is durable (or replicated on
    # the survivors) and it is out of the rendezvous, so it only costs money from then on.
    left_at: float | None = None
    # Why fleetd bought it (the launch intent's purpose, joined by the instance's launch-token
    # tag); None for an instance bought before the state recorded it or adopted without a tag.
    launch_purpose: LaunchPurpose | None = None
    # The job's code version its agent says it runs ("" unknown, or code baked into the image).
    code_digest: str = ""

    @property
    def worst_case_price_per_hour(self) -> float:
        if self.max_price_per_hour is None:
            return self.price_per_hour
        return max(self.price_per_hour, self.max_price_per_hour)

    @property
    def has_left(self) -> bool:
        """Out of training for good: LEAVING, or its trainer exited after its drain or notice
        began (an exit before that is a crash the supervisor restarts, not a departure)."""
        if self.phase is NodePhase.LEAVING:
            return True
        if self.left_at is None:
            return False
        began = [t for t in (self.drain_started_at, self.notice_at) if t is not None]
        return bool(began) and self.left_at >= min(began)

    @property
    def leaving(self) -> bool:
        """Already on its way out: counts for spend, not for capacity."""
        return self.phase in (NodePhase.DRAINING, NodePhase.LEAVING, NodePhase.TERMINATED)


_NODE_FIELDS = tuple(f.name for f in fields(Node))


def _node_with_source() -> str:
    # One line per field, written out (as dataclasses writes __init__): a loop over the field
    # names with getattr costs twice as much per node.
    lines = [f"    _set(new, {k!r}, changes[{k!r}] if {k!r} in changes else node.{k})\n" for k in _NODE_FIELDS]
    return (
        "def node_with(node, _new=object.__new__, _set=object.__setattr__, **changes):\n"
        "    new = _new(Node)\n" + "".join(lines) + "    return new\n"
    )


_ns: dict[str, object] = {"Node": Node}
exec(_node_with_source(), _ns)  # noqa: S102  (generated from the field names above, nothing else)
node_with: Callable[..., Node] = _ns["node_with"]  # type: ignore[assignment]
node_with.__doc__ = """``dataclasses.replace`` for Node on the per-pass path (every node, every pass,
twice: at 2,000 nodes replace's per-call introspection was ~1.5 s of a loaded box's pass,
bench/agents_load.py): the same fields copied, without introspection or __init__."""


@dataclass(frozen=True, slots=True)
class Action:
    """Base of every decision. ``reason`` is logged verbatim: write it for an operator."""

    reason: str


class LaunchPurpose(StrEnum):
    CAPACITY = "capacity"  # reach the target node count (first start, scale-up, replace a loss)
    REBALANCE_PREBUY = "rebalance-prebuy"  # counts against rebalance churn per hour
    RETURN_TO_SPOT = "return-to-spot"  # spot node that will replace an on-demand one
    ON_DEMAND_FALLBACK = "on-demand-fallback"


@dataclass(frozen=True, slots=True)
class Launch(Action):
    count: int
    market: Market
    # Ranked candidate pools for one CreateFleet request (diversified over types and zones).
    pools: tuple[PoolId, ...]
    # Spot: the bid per instance (AWS reclaims the node above it); None on on-demand.
    max_price_per_hour: float | None = None
    # The current hourly price the planner budgeted for each node (the highest among `pools`);
    # the burn-rate cap is checked at this price, the total cap at max_price_per_hour.
    budgeted_price_per_hour: float = 0.0
    purpose: LaunchPurpose = LaunchPurpose.CAPACITY
    # Burn-rate room left under budget.max_usd_per_hour before this launch: a ceiling for
    # CreateFleet's MaxTotalPrice, so EC2 itself never buys past the cap.
    max_total_price_per_hour: float | None = None

    @property
    def worst_case_price_per_hour(self) -> float:
        return max(self.budgeted_price_per_hour, self.max_price_per_hour or 0.0)


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


class BudgetLevel(StrEnum):
    """Graded responses as the spend forecast nears budget.total_usd (DESIGN.md)."""

    NORMAL = "normal"
    WARN = "warn"
    FORBID_ON_DEMAND = "forbid-on-demand"
    SHRINK = "shrink"
    STOP = "stop"  # at the cap: coordinated checkpoint, then stop cleanly


@dataclass(frozen=True, slots=True)
class BudgetStatus:
    """The budget as the planner saw it (for logs, /metrics and `fleetd status`)."""

    level: BudgetLevel = BudgetLevel.NORMAL
    spent_usd: float = 0.0
    burn_usd_per_hour: float = 0.0  # nodes kept (not leaving), at current prices, after the plan
    forecast_usd: float = 0.0  # spent + burn over budget.forecast_horizon_s
    committed_usd: float = 0.0  # spent + worst case until the next decision and a clean stop
    runway_h: float | None = None  # hours until total_usd at the current burn (None: no burn)
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PlannerMemory:
    """What the stateless planner keeps between passes, as one value (fleetd/policy/memory.py
    says how each plan and each executed action changes it). The caller hands it back in the
    next Observation; ``Plan.memory`` is the memory once that plan is taken."""

    target_nodes: int | None = None
    last_scaling_at: float | None = None
    spot_unavailable_since: float | None = None
    budget_level: BudgetLevel = BudgetLevel.NORMAL
    stop_issued_at: float | None = None


_A = TypeVar("_A", bound=Action)


@dataclass(frozen=True, slots=True)
class Plan:
    actions: tuple[Action, ...] = ()
    # Decisions that led to no action are still worth a log line ("holding at 3: cool-down").
    notes: tuple[str, ...] = field(default=())
    # The node count the planner now aims for (kept in ``memory`` with when it last changed).
    target_nodes: int | None = None
    target_reason: str = ""  # why the target is what it is (scaling.decide_target's reason)
    budget: BudgetStatus = field(default_factory=BudgetStatus)
    # True when this plan needed spot capacity and no spot pool could be tried: ``memory`` starts
    # spot_unavailable_since (on-demand fallback after capacity.spot_wait_s).
    spot_short: bool = False
    # The deadline rule's call on this pass (fleetd/policy/deadline.py); None without a deadline.
    deadline: DeadlineCall | None = None
    # Plan again this soon (seconds) rather than after the reconcile interval: the planner is
    # waiting out a short window (a wave of notices settling before its replacements are bought).
    replan_in_s: float | None = None
    # The planner's memory once this plan is taken (fleetd/policy/memory.py): what the caller
    # keeps and shows the next pass. None only in a plan not made by ``planner.plan``.
    memory: PlannerMemory | None = None

    def of_type(self, kind: type[_A]) -> tuple[_A, ...]:
        return tuple(a for a in self.actions if isinstance(a, kind))
