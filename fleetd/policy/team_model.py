"""The team allocator's vocabulary (issue 33): one budget, many jobs, priorities, regions.

Plain frozen data; the rules are in ``team.py`` (allocation) and ``team_region.py`` (placement and
moves). Prices are USD per node-hour, the price the caller commits to (the daemon passes the spot
bid or the on-demand price, the simulator the price it bills): the allocator's forecast is only as
safe as these prices, and the caller runs it again whenever a price or the capacity changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class TeamActionKind(StrEnum):
    START = "start"  # a job never placed gets its first nodes
    GROW = "grow"
    SHRINK = "shrink"  # nodes leave through the coordinated checkpoint (0 steps lost)
    KEEP = "keep"
    MOVE = "move"  # checkpoint, drain, copy the checkpoint to the new region, resume there
    PAUSE = "pause"  # checkpoint first: every node drains through the coordinated checkpoint
    PAUSED = "paused"  # stays paused: no room yet
    RESUME = "resume"  # a paused job gets nodes again (in its checkpoint's region)
    PENDING = "pending"  # never started and cannot start yet


@dataclass(frozen=True, slots=True)
class TeamBudget:
    """The team's caps and what it has spent. ``horizon_s``: how far ahead the forecast looks
    (``budget.forecast_horizon_s``); the allotted burn over it never crosses ``total_usd``."""

    total_usd: float
    max_usd_per_hour: float
    spent_usd: float
    horizon_s: float

    def __post_init__(self) -> None:
        if not self.horizon_s > 0:
            raise ValueError("horizon_s must be > 0")
        if self.total_usd < 0 or self.max_usd_per_hour < 0 or self.spent_usd < 0:
            raise ValueError("budget figures must be >= 0")


@dataclass(frozen=True, slots=True)
class JobCap:
    """Optional per-job caps, under the team's."""

    total_usd: float | None = None
    max_usd_per_hour: float | None = None


@dataclass(frozen=True, slots=True)
class RegionOffer:
    """What one allowed region offers one job: a new node's price and the expected cost per useful
    GPU-hour there (placement.py's score: price, interruptions, throughput)."""

    region: str
    node_price_per_hour: float
    usd_per_useful_gpu_hour: float


def useful_at(curve: tuple[float, ...], nodes: int) -> float:
    """Useful node-equivalents at ``nodes`` on ``curve`` (at 1, 2, ... nodes; () is ideal
    scaling); past its last entry a node adds what the last one did."""
    if nodes <= len(curve):
        return curve[nodes - 1] if nodes > 0 else 0.0
    if not curve:
        return float(nodes)
    last = curve[-1] - (curve[-2] if len(curve) > 1 else 0.0)
    return curve[-1] + (nodes - len(curve)) * last


@dataclass(frozen=True, slots=True)
class TeamJob:
    """One job as the team allocator sees it.

    ``max_nodes`` is what the job's own planner wants now (its target, or its configured maximum);
    the allotment never exceeds it. ``region`` is where its nodes and checkpoints are (None: never
    placed). ``deadline_nodes`` is what its deadline rule asks for (None: no deadline); it replaces
    ``min_nodes`` as the job's need, within the budget.
    """

    name: str
    priority: int
    min_nodes: int
    max_nodes: int
    offers: tuple[RegionOffer, ...]
    region: str | None = None
    node_prices: tuple[float, ...] = ()  # its current nodes' prices (in ``region``)
    paused: bool = False
    spent_usd: float = 0.0
    cap: JobCap = field(default_factory=JobCap)
    deadline_nodes: int | None = None
    remaining_gpu_hours: float = 0.0  # useful GPU-hours of work left (a move's payback)
    checkpoint_gb: float = 0.0
    # Its scaling model: useful node-equivalents at 1, 2, ... nodes (throughput at n nodes over one
    # node's ideal, n x scaling efficiency; measured or modelled). () is ideal scaling; past the
    # last entry a node adds what the last one did (scaling.py's "assumed equal" rule).
    useful_nodes: tuple[float, ...] = ()
    min_marginal_efficiency: float = 0.7  # its scaling.min_marginal_efficiency (the default)
    efficiency_hysteresis: float = 0.1  # its scaling.efficiency_hysteresis: a node it has keeps a lower bar
    paused_at: float | None = None  # when it was paused (the caller's clock); None: not recorded

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"job {self.name}: need 1 <= min_nodes <= max_nodes")
        if not self.offers:
            raise ValueError(f"job {self.name}: no allowed region")

    @property
    def placed(self) -> bool:
        """It has a region: nodes or a checkpoint there."""
        return self.region is not None

    @property
    def running(self) -> bool:
        return self.placed and not self.paused

    def offer(self, region: str | None) -> RegionOffer | None:
        return next((o for o in self.offers if o.region == region), None)

    def useful(self, nodes: int) -> float:
        """Useful node-equivalents at ``nodes`` nodes (its scaling model)."""
        return useful_at(self.useful_nodes, nodes)

    def need(self) -> int:
        """Nodes it asks for before any job of its priority gets more than its need."""
        if self.deadline_nodes is None:
            return self.min_nodes
        return max(self.min_nodes, min(self.max_nodes, self.deadline_nodes))


@dataclass(frozen=True, slots=True)
class TeamSettings:
    transfer_usd_per_gb: float = 0.02  # inter-region transfer (S3 to another region)
    changeover_h: float = 0.25  # buying nodes until they train, at the job's burn (d)
    # Extras: a higher priority's next node goes first while it adds at least (1 - band) of the
    # best useful node-equivalents per dollar on offer; outside the band the cheaper step wins.
    extra_priority_band: float = 0.3
    # Resume (hysteresis): a paused job's need must fit with this share to spare (nodes and USD/h),
    # unless it has been paused min_pause_s; and the team's total must cover what is allotted with
    # it over the horizon plus twice its changeover (it trains at least as long as it restarts).
    resume_margin: float = 0.5
    min_pause_s: float = 1800.0


@dataclass(frozen=True, slots=True)
class Allotment:
    """A job's share this pass: nodes it may run, where, and the burn that is its budget."""

    job: str
    kind: TeamActionKind
    nodes: int
    region: str | None
    usd_per_hour: float
    reason: str
    move_from: str | None = None


@dataclass(frozen=True, slots=True)
class TeamPlan:
    allotments: tuple[Allotment, ...]
    room_usd_per_hour: float  # what the team may burn this pass (both caps)
    burn_usd_per_hour: float  # what the allotments burn
    forecast_usd: float  # spent + burn over the horizon
    left_usd_per_hour: float  # room not allotted
    capacity_left: dict[str, int | None]  # nodes still obtainable per region (None: unbounded)
    reason: str

    def of(self, job: str) -> Allotment:
        return next(a for a in self.allotments if a.job == job)
