"""Several jobs, one team budget, one or more regions: the team allocator against a split budget.

A time-stepped model (one pass per ``tick_s``), coarser than the single-job event engine
(engine.py) and the same for both arms, so the comparison is like for like: the same jobs, start
offsets, traces (one per region: its spot capacity over time), prices, changeover and re-form
costs. Only who decides differs:
- ``team``: one `fleetd.policy.team.allocate` over every job with the team budget;
- ``split``: each job alone through the same `allocate` with ``1/N`` of the team budget (total and
  per hour), seeing the capacity the other fleets left (EC2 serves first come; the order rotates
  each pass so no job is always first).
Mechanics, per pass: a capacity drop takes the newest nodes (notice path: a re-form, 0 steps
lost); a shrink drains nodes (a re-form); a pause drains all (checkpoint first, 0 steps lost); a
joining node trains after the agent's start-up and a join round; a start, resume or move trains
after the changeover d (cold start and restore; a move also pays the checkpoint's copy). Nodes are
billed per pass at their price from purchase to release; progress is the job's throughput at its
training nodes (engine's scaling model). The region's cost score for a job is its spot price while
the region has capacity for its minimum, else its on-demand price (what staying would cost).
Each job shows the allocator its scaling model (``useful_nodes``, from the spec) and when it was
paused; the pass's time is ``now``. ``TeamScenario.rules`` sets the allocator's knobs (sweeps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from fleetd.policy.team import allocate
from fleetd.policy.team_asks import deadline_ask
from fleetd.policy.team_model import Allotment, JobCap, RegionOffer, TeamActionKind, TeamBudget, TeamJob, TeamSettings
from fleetd.sim import defaults as d
from fleetd.sim.job import JobSpec
from fleetd.sim.traces import Trace

MODES = ("team", "split")


@dataclass(frozen=True, slots=True)
class SimRegion:
    name: str
    trace: Trace
    spot_price: float
    on_demand_price: float


@dataclass(frozen=True, slots=True)
class TeamSimJob:
    name: str
    priority: int
    spec: JobSpec  # work, throughput model, min/max nodes, checkpoint size, deadline (from t=0)
    regions: tuple[str, ...]
    start_s: float = 0.0
    cap: JobCap = field(default_factory=JobCap)


@dataclass(frozen=True, slots=True)
class TeamScenario:
    regions: tuple[SimRegion, ...]
    jobs: tuple[TeamSimJob, ...]
    total_usd: float
    max_usd_per_hour: float
    horizon_s: float = 3600.0
    tick_s: float = 60.0
    changeover_s: float = d.CHANGEOVER_S.value
    join_s: float = d.AGENT_UP_S.value + d.FLEETD_JOIN_REFORM_S.value
    reform_s: float = d.FLEETD_REFORM_S.value + d.CHECKPOINT_STALL_S.value
    transfer_usd_per_gb: float = 0.02
    copy_gb_per_s: float = d.UPLOAD_GB_PER_S.value
    rules: TeamSettings = TeamSettings()  # the allocator's knobs; transfer and changeover from above

    @property
    def duration_s(self) -> float:
        return min(r.trace.duration_s for r in self.regions)


@dataclass
class _JobState:
    job: TeamSimJob
    region: str | None = None
    nodes: list[tuple[float, float]] = field(default_factory=list)  # (price, trains from)
    paused: bool = False
    paused_at: float | None = None
    steps: float = 0.0
    spent: float = 0.0
    stalled_until: float = 0.0
    done_at: float | None = None
    pauses: int = 0
    moves: int = 0
    decisions: list[str] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.done_at is None


@dataclass(frozen=True, slots=True)
class JobOutcome:
    name: str
    priority: int
    steps_done: float
    total_steps: float
    spend_usd: float
    finished_at_h: float | None
    deadline_met: bool | None
    pauses: int
    moves: int


@dataclass(frozen=True, slots=True)
class TeamOutcome:
    mode: str
    spend_usd: float
    budget_usd: float
    steps_done: float
    jobs: tuple[JobOutcome, ...]
    max_burn_usd_per_hour: float
    decisions: tuple[str, ...]

    @property
    def usd_per_1k_steps(self) -> float | None:
        return 1000.0 * self.spend_usd / self.steps_done if self.steps_done > 0 else None


def _team_job(sc: TeamScenario, s: _JobState, now: float, capacity: dict[str, int]) -> TeamJob:
    spec = s.job.spec
    offers = []
    for r in sc.regions:
        if r.name in s.job.regions:
            score = r.spot_price if capacity[r.name] >= spec.min_nodes else r.on_demand_price
            offers.append(RegionOffer(r.name, r.spot_price, score / spec.efficiency(spec.max_nodes)))
    left = max(0.0, spec.total_steps - s.steps)
    deadline_nodes = None
    if spec.deadline_s is not None:
        deadline_nodes = deadline_ask(left, spec.deadline_s - now - sc.changeover_s, spec.throughput, spec.max_nodes)
    return TeamJob(
        name=s.job.name,
        priority=s.job.priority,
        min_nodes=spec.min_nodes,
        max_nodes=spec.max_nodes,
        offers=tuple(offers),
        region=s.region,
        node_prices=tuple(p for p, _ in s.nodes),
        paused=s.paused,
        spent_usd=s.spent,
        cap=s.job.cap,
        deadline_nodes=deadline_nodes,
        remaining_gpu_hours=left / spec.steps_per_node_s / 3600.0,
        checkpoint_gb=spec.checkpoint_gb,
        useful_nodes=tuple(spec.throughput(n) / spec.steps_per_node_s for n in range(1, spec.max_nodes + 1)),
        paused_at=s.paused_at if s.paused else None,
    )


def run_team(sc: TeamScenario, mode: str) -> TeamOutcome:
    """Replay the scenario with ``mode`` ("team" or "split") deciding."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    states = [_JobState(j) for j in sc.jobs]
    prices = {r.name: r.spot_price for r in sc.regions}
    settings = replace(sc.rules, transfer_usd_per_gb=sc.transfer_usd_per_gb, changeover_h=sc.changeover_s / 3600.0)
    spent, max_burn = 0.0, 0.0
    n_jobs = len(sc.jobs)
    t = 0.0
    for tick in range(int(sc.duration_s // sc.tick_s)):
        t = tick * sc.tick_s
        capacity = {r.name: r.trace.live_at(t) for r in sc.regions}
        _interrupt(states, capacity, t, sc)
        live = [s for s in states if s.active and s.job.start_s <= t]
        if mode == "team":
            budget = TeamBudget(sc.total_usd, sc.max_usd_per_hour, spent, sc.horizon_s)
            plan = allocate(budget, [_team_job(sc, s, t, capacity) for s in live], capacity, settings, now=t)
            for s in live:
                _apply(s, plan.of(s.job.name), t, sc, prices)
        else:
            for s in live[tick % max(1, len(live)) :] + live[: tick % max(1, len(live))]:
                free = {
                    r: max(0, c - sum(len(o.nodes) for o in states if o is not s and o.region == r))
                    for r, c in capacity.items()
                }
                share = TeamBudget(sc.total_usd / n_jobs, sc.max_usd_per_hour / n_jobs, s.spent, sc.horizon_s)
                plan = allocate(share, [_team_job(sc, s, t, free)], free, settings, now=t)
                _apply(s, plan.of(s.job.name), t, sc, prices)
        burn = sum(p for s in states for p, _ in s.nodes)
        max_burn = max(max_burn, burn)
        for s in states:
            cost = sum(p for p, _ in s.nodes) * sc.tick_s / 3600.0
            s.spent += cost
            spent += cost
            _progress(s, t, sc)
    total_budget = sc.total_usd
    jobs = tuple(_outcome(s) for s in states)
    decisions = tuple(x for s in states for x in s.decisions)
    return TeamOutcome(mode, spent, total_budget, sum(j.steps_done for j in jobs), jobs, max_burn, decisions)


def _interrupt(states: Sequence[_JobState], capacity: dict[str, int], now: float, sc: TeamScenario) -> None:
    """A capacity drop takes nodes away, newest first, from the job holding most (EC2 does not
    know priorities)."""
    for region, cap in capacity.items():
        holders = [s for s in states if s.region == region and s.nodes]
        while sum(len(s.nodes) for s in holders) > cap:
            s = max(holders, key=lambda s: (len(s.nodes), s.job.name))
            s.nodes.pop()
            s.stalled_until = max(s.stalled_until, now) + sc.reform_s


def _apply(s: _JobState, a: Allotment, now: float, sc: TeamScenario, prices: dict[str, float]) -> None:
    kind = a.kind
    if kind not in (TeamActionKind.KEEP, TeamActionKind.PENDING, TeamActionKind.PAUSED):
        s.decisions.append(f"{now / 3600:.2f} h {s.job.name}: {a.reason}")
    if kind is TeamActionKind.PAUSE:
        s.nodes.clear()
        s.paused, s.paused_at = True, now
        s.pauses += 1
        return
    if a.nodes == 0 or a.region is None:
        return
    if kind is TeamActionKind.MOVE:
        s.nodes.clear()
        s.moves += 1
        copy_s = s.job.spec.checkpoint_gb / sc.copy_gb_per_s
        s.spent += s.job.spec.checkpoint_gb * sc.transfer_usd_per_gb
        ready = now + copy_s + sc.changeover_s
    elif kind in (TeamActionKind.START, TeamActionKind.RESUME) or not s.nodes:
        ready = now + sc.changeover_s
    else:
        ready = now + sc.join_s
    s.region, s.paused = a.region, False
    if a.nodes < len(s.nodes):
        s.nodes.sort()
        del s.nodes[a.nodes :]
        s.stalled_until = max(s.stalled_until, now) + sc.reform_s
    while len(s.nodes) < a.nodes:
        s.nodes.append((prices[a.region], ready))


def _progress(s: _JobState, now: float, sc: TeamScenario) -> None:
    if not s.active or not s.nodes:
        return
    end = now + sc.tick_s
    training = sum(1 for _, ready in s.nodes if ready <= now)
    useful_s = max(0.0, end - max(now, s.stalled_until))
    if training == 0 or useful_s <= 0:
        return
    spec = s.job.spec
    s.steps = min(spec.total_steps, s.steps + spec.throughput(training) * useful_s)
    if s.steps >= spec.total_steps - 1e-9:
        s.done_at = end
        s.nodes.clear()


def _outcome(s: _JobState) -> JobOutcome:
    spec = s.job.spec
    met = None
    if spec.deadline_s is not None:
        met = s.done_at is not None and s.done_at <= spec.deadline_s
    return JobOutcome(
        s.job.name,
        s.job.priority,
        s.steps,
        spec.total_steps,
        s.spent,
        None if s.done_at is None else s.done_at / 3600.0,
        met,
        s.pauses,
        s.moves,
    )
