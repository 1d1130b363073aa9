"""What the arbiter knows of one job, read from disk, and the allocator's view of it (pure).

A job is read from its own daemon's files (no call to the daemon, which may be down): its config
(fleet size, region, state directory), its ``status.json`` snapshot (spend, live nodes and their
prices, the offered pools, the job's state) and the allotment the arbiter wrote last. A job the
arbiter cannot plan for (config unreadable, no snapshot yet, no priced pool) gets no new share
and keeps the one it has: its daemon plans inside the last one (none yet: it waits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from fleetd.config import FleetdConfig
from fleetd.policy.team_asks import deadline_ask, scaling_curve, throughput_at
from fleetd.policy.team_model import JobCap, RegionOffer, TeamActionKind, TeamJob
from fleetd.snapshot import PoolView, StatusSnapshot
from fleetd.team.allotment_file import AllotmentRecord
from fleetd.team.config import TeamJobEntry

LIVE = ("pending", "running")


@dataclass(frozen=True, slots=True)
class JobSeen:
    entry: TeamJobEntry
    cfg: FleetdConfig | None = None
    snapshot: StatusSnapshot | None = None
    previous: AllotmentRecord | None = None
    problem: str | None = None  # why the job could not be read
    elsewhere: tuple[RegionOffer, ...] = ()  # its other allowed regions, priced (fleetd/team/region_prices.py)

    @property
    def spent_usd(self) -> float:
        """Its spend as its daemon last wrote it (0 before the first snapshot)."""
        snap = self.snapshot
        return snap.budget.spent_usd if snap is not None and snap.budget is not None else 0.0

    @property
    def over(self) -> bool:
        """The job ended (succeeded, failed, cancelled): it takes no share; its spend still counts."""
        snap = self.snapshot
        return snap is not None and snap.job is not None and snap.job.terminal


PoolPrice = tuple[float | None, float | None, float | None]  # (price per node-hour, GPUs, relative throughput)


def best_offer(region: str, pools: Iterable[PoolPrice]) -> RegionOffer | None:
    """The region's offer: the pool with the lowest price per useful GPU-hour (the price over the
    pool's GPU count and relative throughput), None when no pool has a price."""
    best: tuple[float, float] | None = None
    for price, gpus, relative in pools:
        if price is None or price <= 0:
            continue
        per_useful = price / ((relative or 1.0) * (gpus or 1))
        if best is None or per_useful < best[1]:
            best = (price, per_useful)
    return RegionOffer(region, best[0], best[1]) if best is not None else None


def _spot_pools(seen: JobSeen, now: float) -> tuple[list[PoolView], list[PoolView]]:
    """The job's offered pools, and those of them its planner may buy spot in now (no capacity
    error in force)."""
    offered = [p for p in seen.snapshot.pools if p.offered] if seen.snapshot is not None else []
    open_ = [p for p in offered if p.capacity_error_until is None or p.capacity_error_until <= now]
    return offered, open_


def region_dry(seen: JobSeen, now: float) -> bool:
    """Every pool the job may buy in its region has a spot capacity error in force: the region
    has no spot for it now (EC2 gives no better signal than trying)."""
    offered, open_ = _spot_pools(seen, now)
    return bool(offered) and not open_


def offer_of(seen: JobSeen, now: float) -> RegionOffer | None:
    """The job's own region as its daemon prices it: the spot price of the pools it may still buy
    in; in a dry region, their on-demand prices (what staying there costs)."""
    if seen.cfg is None or seen.snapshot is None:
        return None
    region = seen.cfg.aws.region
    offered, open_ = _spot_pools(seen, now)
    if offered and not open_:
        return best_offer(region, ((p.on_demand_price, p.gpus, p.relative_throughput) for p in offered))
    return best_offer(region, ((p.spot_price, p.gpus, p.relative_throughput) for p in open_))


def dry_regions(seen: Sequence[JobSeen], now: float) -> frozenset[str]:
    """Regions where some job of the team finds no spot capacity in any pool it may buy, named
    by the region its status describes (a job mid-move is not read into its new region)."""
    return frozenset(
        s.snapshot.region
        for s in seen
        if s.snapshot is not None and s.snapshot.region is not None and region_dry(s, now)
    )


def held_in(seen: Sequence[JobSeen], regions: frozenset[str]) -> dict[str, int]:
    """A dry region's capacity for the allocator: the nodes the team's jobs hold there now (they
    keep them; nobody gets more)."""
    held = dict.fromkeys(regions, 0)
    for s in seen:
        snap = s.snapshot
        if snap is not None and snap.region in held:
            held[snap.region] += sum(1 for n in snap.live_nodes if n.ec2_state in LIVE)
    return held


def _left_steps(cfg: FleetdConfig, snap: StatusSnapshot) -> float | None:
    """Steps of work left (its total less the highest step its nodes or checkpoint reached)."""
    if cfg.job.total_steps is None:
        return None
    live = [n for n in snap.live_nodes if n.ec2_state in LIVE]
    steps = [n.step for n in live if n.step is not None]
    done = max([*steps, snap.checkpoint.step if snap.checkpoint is not None else 0])
    return float(max(0, cfg.job.total_steps - done))


def _pace(cfg: FleetdConfig, snap: StatusSnapshot) -> Callable[[int], float] | None:
    """The job's steps/s at n nodes: its measured curve, else its job file's pace at max_nodes."""
    declared = cfg.job.steps_per_s / cfg.fleet.max_nodes if cfg.job.steps_per_s is not None else None
    return throughput_at(snap.throughput_by_nodes, declared)


def deadline_nodes(seen: JobSeen, now: float) -> int | None:
    """What the job's deadline asks of the team (fleetd/policy/team_asks.py), within its size:
    None without a deadline; its ``max_nodes`` while its pace is unknown (the safe side)."""
    cfg, snap = seen.cfg, seen.snapshot
    if cfg is None or snap is None or cfg.job.deadline is None:
        return None
    left = _left_steps(cfg, snap)
    rate = _pace(cfg, snap)
    if left is None or rate is None:
        return cfg.fleet.max_nodes
    time_left = cfg.job.deadline.timestamp() - now - cfg.job.changeover_s
    ask = deadline_ask(left, time_left, rate, cfg.fleet.max_nodes)
    return max(max(1, cfg.fleet.min_nodes), ask)


def remaining_gpu_hours(seen: JobSeen) -> float:
    """Useful GPU-hours of work the job has left, for a move's payback: from its total steps, its
    progress and its pace (measured by its nodes, else its config's ``job.steps_per_s`` at
    ``fleet.max_nodes``). 0 when any of them is unknown: a move is then never shown to pay."""
    cfg, snap = seen.cfg, seen.snapshot
    left = _left_steps(cfg, snap) if cfg is not None and snap is not None else None
    if cfg is None or snap is None or left is None:
        return 0.0
    live = [n for n in snap.live_nodes if n.ec2_state in LIVE]
    gpus = max((p.gpus or 1 for p in snap.pools if p.offered), default=1)
    # Every node reports the job's own pace (not its share of it): the fastest report is the job's.
    reported = max((n.steps_per_s or 0.0 for n in live), default=0.0)
    if reported > 0:
        return left / reported / 3600.0 * len(live) * gpus
    # No node training now (paused, stopped for a move): the pace measured before, else declared.
    nodes = cfg.fleet.max_nodes
    rate = _pace(cfg, snap)
    if rate is None or rate(nodes) <= 0:
        return 0.0
    return left / rate(nodes) / 3600.0 * nodes * gpus


def team_job(seen: JobSeen, now: float) -> TeamJob | str:
    """The allocator's view of the job, or why it cannot be planned for this pass."""
    if seen.problem is not None:
        return seen.problem
    cfg, snap, prev = seen.cfg, seen.snapshot, seen.previous
    if cfg is None or snap is None:
        return "no status from the job's daemon yet (is fleetd@NAME running?)"
    if snap.region is not None and snap.region != cfg.aws.region:
        # Its checkpoint is in the new region (region.json) and its daemon has not started there
        # yet: its status still describes the old region's pools. Its allotment stays as written.
        return f"moving from {snap.region} to {cfg.aws.region}: waiting for its daemon's first pass there"
    offer = offer_of(seen, now)
    if offer is None:
        return "no priced spot pool in the job's status yet"
    live = [n for n in snap.live_nodes if n.ec2_state in LIVE]
    paused = prev is not None and prev.kind in (TeamActionKind.PAUSE, TeamActionKind.PAUSED)
    placed = bool(live) or snap.checkpoint is not None or (prev is not None and prev.kind != TeamActionKind.PENDING)
    return TeamJob(
        name=seen.entry.name,
        priority=seen.entry.priority,
        min_nodes=max(1, cfg.fleet.min_nodes),
        max_nodes=cfg.fleet.max_nodes,
        offers=(offer, *(o for o in seen.elsewhere if o.region != offer.region)),
        region=offer.region if placed else None,
        node_prices=tuple(n.price_per_hour for n in live) if not paused else (),
        paused=paused,
        spent_usd=seen.spent_usd,
        cap=JobCap(seen.entry.total_usd, seen.entry.max_usd_per_hour),
        deadline_nodes=deadline_nodes(seen, now),
        remaining_gpu_hours=remaining_gpu_hours(seen),
        checkpoint_gb=seen.entry.checkpoint_gb,
        useful_nodes=scaling_curve(snap.throughput_by_nodes),
        min_marginal_efficiency=cfg.scaling.min_marginal_efficiency,
        paused_at=prev.paused_at if paused and prev is not None else None,
    )


def paused_at(kind: TeamActionKind, prev: AllotmentRecord | None, now: float) -> float | None:
    """When the job's current pause began: now for a new pause, carried while it stays paused."""
    if kind is TeamActionKind.PAUSE:
        return now
    if kind is TeamActionKind.PAUSED:
        return prev.paused_at if prev is not None and prev.paused_at is not None else now
    return None
