"""What the arbiter knows of one job, read from disk, and the allocator's view of it (pure).

A job is read from its own daemon's files (no call to the daemon, which may be down): its config
(fleet size, region, state directory), its ``status.json`` snapshot (spend, live nodes and their
prices, the offered pools, the job's state) and the allotment the arbiter wrote last. A job the
arbiter cannot plan for (config unreadable, no snapshot yet, no priced pool) gets no new share
and keeps the one it has: its daemon plans inside the last one (none yet: it waits).
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetd.config import FleetdConfig
from fleetd.policy.team_model import JobCap, RegionOffer, TeamActionKind, TeamJob
from fleetd.snapshot import StatusSnapshot
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


def offer_of(seen: JobSeen) -> RegionOffer | None:
    """The job's region as its daemon prices it: the cheapest offered pool's spot price per node,
    and per useful GPU-hour (the price over the pool's relative throughput and GPU count)."""
    if seen.cfg is None or seen.snapshot is None:
        return None
    best: tuple[float, float] | None = None
    for pool in seen.snapshot.pools:
        if not pool.offered or pool.spot_price is None or pool.spot_price <= 0:
            continue
        useful = (pool.relative_throughput or 1.0) * (pool.gpus or 1)
        per_useful = pool.spot_price / useful
        if best is None or per_useful < best[1]:
            best = (pool.spot_price, per_useful)
    if best is None:
        return None
    return RegionOffer(seen.cfg.aws.region, best[0], best[1])


def team_job(seen: JobSeen) -> TeamJob | str:
    """The allocator's view of the job, or why it cannot be planned for this pass."""
    if seen.problem is not None:
        return seen.problem
    cfg, snap, prev = seen.cfg, seen.snapshot, seen.previous
    if cfg is None or snap is None:
        return "no status from the job's daemon yet (is fleetd@NAME running?)"
    offer = offer_of(seen)
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
        offers=(offer,),
        region=offer.region if placed else None,
        node_prices=tuple(n.price_per_hour for n in live) if not paused else (),
        paused=paused,
        spent_usd=seen.spent_usd,
        cap=JobCap(seen.entry.total_usd, seen.entry.max_usd_per_hour),
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
