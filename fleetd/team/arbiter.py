"""``fleetd team run``: the team's one planning loop over every job (issue 33).

Every ``team.interval_s``: read each job's config, status snapshot and last allotment
(fleetd/team/inputs.py), run the team allocator (fleetd/policy/team.py) over the jobs it can plan
for, split what the team has left into per-job totals (fleetd/policy/team_share.py) and write each
job's allotment (fleetd/team/allotment_file.py). Each job's own daemon (``fleetd@NAME``, with
``[team] member = true``) places and drains its nodes inside its allotment: one job's crash or
restart stops that job only, and the single-job path every test exercises stays the one that runs.

The arbiter keeps no state of its own: what it needs across passes is in the allotments it wrote
(when a job was paused) and in the jobs' snapshots (spend, nodes). Restarted, it carries on.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from fleetd.config import FleetdConfig, load
from fleetd.jobs.submission import job_as_run
from fleetd.policy.team import allocate
from fleetd.policy.team_model import JobCap, TeamActionKind, TeamBudget, TeamJob, TeamSettings
from fleetd.policy.team_share import job_totals
from fleetd.protocol.errors import ProtocolError
from fleetd.shared.logs import get_logger
from fleetd.shared.settings import ConfigError
from fleetd.shared.waits import wait_set
from fleetd.snapshot import read_snapshot
from fleetd.team.allotment_file import AllotmentRecord, read_allotment, write_allotment
from fleetd.team.claims import kept_claim, planned_claim, spend_known, stale_for_s
from fleetd.team.config import TeamConfig, TeamJobEntry
from fleetd.team.inputs import JobSeen, dry_regions, held_in, paused_at, team_job
from fleetd.team.region_file import RegionError, effective_config
from fleetd.team.region_prices import RegionPricer
from fleetd.team.team_pass import TeamPass

log = get_logger(__name__)


def read_job(entry: TeamJobEntry) -> JobSeen:
    """One job from its files (blocking: call it in a thread). Never raises: a job that cannot be
    read or planned for carries the reason, and the pass goes on with the others. A job whose
    config does not make it a member is not planned for, but its spend still counts against the
    team's total (the team cannot steer it; it must not pretend that money is left)."""
    try:
        cfg: FleetdConfig = load(entry.config)
    except ConfigError as exc:
        return JobSeen(entry, problem=f"its config cannot be read: {exc.render()}"[:500])
    if entry.state_dir is not None:
        cfg = cfg.model_copy(update={"fleet": cfg.fleet.model_copy(update={"state_dir": entry.state_dir})})
    try:
        cfg = effective_config(cfg)  # the region it runs in after a move (fleetd/team/region_file.py)
    except RegionError as exc:
        return JobSeen(entry, cfg, problem=str(exc)[:500])
    try:
        cfg = job_as_run(cfg)  # its job file's work and pace (a move's payback)
    except (ConfigError, OSError) as exc:
        return JobSeen(entry, cfg, problem=f"its job file cannot be read: {exc}"[:500])
    state_dir = cfg.fleet.state_dir
    try:
        snapshot = read_snapshot(state_dir)
        previous = read_allotment(state_dir)
    except (ProtocolError, OSError) as exc:
        return JobSeen(entry, cfg, problem=f"its state cannot be read: {exc}"[:500])
    problem = None if cfg.team.member else f"{entry.config} does not set [team] member = true"
    return JobSeen(entry, cfg, snapshot, previous, problem)


def settings_of(cfg: TeamConfig) -> TeamSettings:
    t = cfg.team
    return TeamSettings(
        extra_priority_band=t.extra_priority_band,
        resume_margin=t.resume_margin,
        min_pause_s=t.min_pause_s,
        changeover_h=t.changeover_s / 3600.0,
        transfer_usd_per_gb=t.transfer_usd_per_gb,
    )


def decide(cfg: TeamConfig, seen: Sequence[JobSeen], now: float) -> TeamPass:
    """The pass's allotments from what was read (pure). Money a job may still spend is kept aside
    first (fleetd/team/claims.py); the allocator and the split get what is left."""
    skipped: dict[str, str] = {}
    planned: list[tuple[JobSeen, TeamJob]] = []
    over: list[JobSeen] = []
    seen = _one_dir_each(seen)
    dry = dry_regions(seen, now)
    for s in seen:
        if s.over:
            over.append(s)
            continue
        late = stale_for_s(s, now)
        view = team_job(s, now)
        if isinstance(view, str):
            skipped[s.entry.name] = view
        elif late is not None:
            skipped[s.entry.name] = f"its status is {late:.0f} s overdue (is fleetd@{s.entry.name} running?)"
        elif not spend_known(s):
            skipped[s.entry.name] = "its status says no spend yet (its daemon's first pass has not planned)"
        else:
            planned.append((s, view))
    claims = {s.entry.name: planned_claim(s, cfg.team.interval_s) for s, _ in planned}
    kept = {s.entry.name: kept_claim(s) for s in seen if s.entry.name not in claims}
    spent = sum(s.spent_usd for s in seen if spend_known(s))
    aside = sum(c.spent_usd for c in (*claims.values(), *kept.values()))
    kept_burn = sum(c.burn_usd_per_hour for c in kept.values())
    written = [_over(cfg, s, now) for s in over]
    if not planned:
        return TeamPass(tuple(seen), None, _decreasing_first(written, seen), skipped, spent)
    # What the others may still spend and burn is taken off the top; the planned jobs share the rest.
    total = cfg.team.total_usd
    budget = TeamBudget(total, max(0.0, cfg.team.max_usd_per_hour - kept_burn), min(aside, total), cfg.team.horizon_s)
    plan = allocate(budget, [v for _, v in planned], held_in(seen, dry), settings_of(cfg), now=now)
    caps = {s.entry.name: JobCap(s.entry.total_usd, s.entry.max_usd_per_hour) for s, _ in planned}
    totals = job_totals(plan, budget, {n: c.spent_usd for n, c in claims.items()}, caps)
    by_name = {s.entry.name: s for s in seen}
    for a in plan.allotments:
        prev = by_name[a.job].previous
        written.append(
            AllotmentRecord(
                team=cfg.team.name,
                job=a.job,
                written_at=now,
                kind=a.kind,
                nodes=a.nodes,
                usd_per_hour=a.usd_per_hour,
                total_usd=totals[a.job],
                region=a.region,
                reason=a.reason[:500],
                paused_at=paused_at(a.kind, prev, now),
            )
        )
    return TeamPass(tuple(seen), plan, _decreasing_first(written, seen), skipped, spent)


def _one_dir_each(seen: Sequence[JobSeen]) -> list[JobSeen]:
    """Two jobs resolved to one state directory (fleetd@NAME sets it in its unit, which the team's
    config must repeat as [[jobs]] state_dir): neither can be told its share."""
    by_dir: dict[Path, list[str]] = {}
    for s in seen:
        if s.cfg is not None:
            by_dir.setdefault(Path(s.cfg.fleet.state_dir), []).append(s.entry.name)
    out = []
    for s in seen:
        where = Path(s.cfg.fleet.state_dir) if s.cfg is not None else None
        names = by_dir.get(where, []) if where is not None else []
        if len(names) > 1:
            others = ", ".join(n for n in names if n != s.entry.name)
            problem = f"shares its state directory {where} with {others}: set [[jobs]] state_dir"
            s = replace(s, problem=problem, previous=None)
        out.append(s)
    return out


def _over(cfg: TeamConfig, s: JobSeen, now: float) -> AllotmentRecord:
    """A job that ended gets nothing more: a new run of it waits for the team's next pass."""
    state = s.snapshot.job.state if s.snapshot is not None and s.snapshot.job is not None else "over"
    return AllotmentRecord(
        team=cfg.team.name,
        job=s.entry.name,
        written_at=now,
        kind=TeamActionKind.PENDING,
        nodes=0,
        usd_per_hour=0.0,
        total_usd=s.spent_usd,
        reason=f"the job is over ({state}): no share until it runs again",
    )


def _decreasing_first(written: list[AllotmentRecord], seen: Sequence[JobSeen]) -> tuple[AllotmentRecord, ...]:
    """Lowered totals and burns are written before raised ones: if the writes stop halfway (a
    full disk, the loop killed), the shares in force still add up to no more than the team's."""
    prev = {s.entry.name: s.previous for s in seen}

    def change(r: AllotmentRecord) -> tuple[float, float]:
        p = prev.get(r.job)
        return (r.total_usd - (p.total_usd if p else 0.0), r.usd_per_hour - (p.usd_per_hour if p else 0.0))

    return tuple(sorted(written, key=change))


def write_pass(cfg: TeamConfig, done: TeamPass) -> None:
    """Write every decided allotment into its job's state directory (blocking)."""
    dirs = {s.entry.name: s.cfg.fleet.state_dir for s in done.seen if s.cfg is not None}
    for record in done.written:
        write_allotment(Path(dirs[record.job]), record)


async def team_pass(
    cfg: TeamConfig, now: float, *, dry_run: bool = False, pricer: RegionPricer | None = None
) -> TeamPass:
    """One pass; ``dry_run`` (``team plan``, ``team status``): decide and say, write and log nothing.
    ``pricer`` keeps other regions' prices between passes (a new one prices them now)."""
    seen = await asyncio.gather(*(asyncio.to_thread(read_job, e) for e in cfg.jobs))
    pricer = pricer or RegionPricer(cfg.team.price_refresh_s)
    seen = [await _priced(pricer, s, now) for s in seen]
    done = decide(cfg, seen, now)
    if not dry_run:
        await asyncio.to_thread(write_pass, cfg, done)
        _log(done)
    return done


async def _priced(pricer: RegionPricer, s: JobSeen, now: float) -> JobSeen:
    """``s`` with its other allowed regions priced (none listed: as it was)."""
    if s.cfg is None or s.problem is not None or not s.cfg.team.regions:
        return s
    return replace(s, elsewhere=await pricer.elsewhere(s.cfg, now))


def _log(done: TeamPass) -> None:
    plan = done.plan
    log.info(
        "team_pass",
        spent_usd=round(done.spent_usd, 4),
        burn_usd_per_hour=round(plan.burn_usd_per_hour, 4) if plan else 0.0,
        room_usd_per_hour=round(plan.room_usd_per_hour, 4) if plan else None,
        allotments={r.job: f"{r.kind} {r.nodes} ${r.usd_per_hour:.2f}/h" for r in done.written},
        skipped=done.skipped or None,
    )
    for r in done.written:
        if r.kind not in ("keep", "paused", "pending"):
            log.warning("team_decision", job=r.job, kind=r.kind, nodes=r.nodes, reason=r.reason)


async def run_team(cfg: TeamConfig, clock: Callable[[], float] = time.time) -> None:
    """Passes every ``interval_s`` until SIGTERM or SIGINT; a failed pass is logged and the next
    one tries again (the jobs keep their last allotments meanwhile). Serves ``/metrics`` on
    ``team.metrics_port`` (0: not served)."""
    from fleetd.metrics import MetricsServer
    from fleetd.team.metrics import TeamMetrics

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metrics = TeamMetrics(cfg.team.name)
    pricer = RegionPricer(cfg.team.price_refresh_s)
    server = None
    try:
        if cfg.team.metrics_port:
            server = await MetricsServer(metrics, cfg.team.metrics_host, cfg.team.metrics_port).start()
        while not stop.is_set():
            now = clock()
            try:
                done = await team_pass(cfg, now, pricer=pricer)
                metrics.observe(done, total_usd=cfg.team.total_usd, max_usd_per_hour=cfg.team.max_usd_per_hour, now=now)
            except (OSError, ValueError) as exc:
                log.error("team_pass_failed", error=repr(exc)[:300])
            await wait_set(stop, cfg.team.interval_s)
    finally:
        if server is not None:
            await server.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log.info("team_stopped")
