"""Team allocator invariants over random teams, prices, capacity changes and time steps (issue 33).

Each drawn run applies the allocator's plan pass after pass: nodes are bought and dropped as
allotted, spend accrues at the allotted burn until the next pass (a pass runs at every price or
capacity change, as in the daemon), capacity shrinks take nodes away (interruptions). After every
pass:
- the team's forecast (spent + burn over the horizon) and its spend never exceed ``total_usd``;
  the burn never exceeds ``max_usd_per_hour``;
- no job's burn exceeds its own per-hour cap, nor its spend plus forecast its total cap;
- no region holds more nodes than it has capacity; allotments stay in [min_nodes, max_nodes] or 0;
- priority: whenever a job H gets no nodes while a lower-priority job L runs, L's allotment is
  needed for nothing H can use: H's need (its cost in H's region) exceeds what the team left
  unallotted plus L's whole burn, or exceeds H's own cap, or H's region has fewer nodes left than
  H's need even with L's nodes there added back (H leaves its region only when a move pays);
- every allotment carries a reason, and its kind agrees with the job's state and node count.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetd.policy.team import allocate, job_room_usd_per_hour
from fleetd.policy.team_model import JobCap, RegionOffer, TeamActionKind, TeamBudget, TeamJob, TeamPlan
from fleetd.policy.team_region import cost_usd_per_hour

EPS = 1e-6
REGIONS = ("r1", "r2", "r3")
prices = st.floats(0.1, 6.0, allow_nan=False)


@dataclass(frozen=True)
class Run:
    total_usd: float
    max_usd_per_hour: float
    horizon_s: float
    jobs: tuple[TeamJob, ...]
    steps: tuple[tuple[float, dict[str, int | None], dict[str, float]], ...]  # dt, capacity, price factor


@st.composite
def runs(draw: st.DrawFn) -> Run:
    regions = REGIONS[: draw(st.integers(1, 3))]
    jobs = []
    for i in range(draw(st.integers(1, 6))):
        allowed = draw(st.lists(st.sampled_from(regions), min_size=1, max_size=len(regions), unique=True))
        offers = tuple(RegionOffer(r, draw(prices), draw(prices)) for r in allowed)
        lo = draw(st.integers(1, 4))
        cap = JobCap(
            draw(st.none() | st.floats(0.0, 200.0)),
            draw(st.none() | st.floats(0.0, 30.0)),
        )
        jobs.append(
            TeamJob(
                name=f"j{i}",
                priority=draw(st.integers(0, 3)),
                min_nodes=lo,
                max_nodes=draw(st.integers(lo, lo + 6)),
                offers=offers,
                cap=cap,
                deadline_nodes=draw(st.none() | st.integers(0, 12)),
                remaining_gpu_hours=draw(st.floats(0.0, 500.0)),
                checkpoint_gb=draw(st.floats(0.0, 500.0)),
                useful_nodes=tuple(draw(st.lists(st.floats(0.0, 12.0), max_size=8))),
            )
        )
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        capacity = {r: draw(st.none() | st.integers(0, 20)) for r in regions}
        factor = {r: draw(st.floats(0.5, 2.0)) for r in regions}
        steps.append((draw(st.floats(1.0, 3600.0)), capacity, factor))
    return Run(
        total_usd=draw(st.floats(0.0, 500.0)),
        max_usd_per_hour=draw(st.floats(0.0, 60.0)),
        horizon_s=3600.0,
        jobs=tuple(jobs),
        steps=tuple(steps),
    )


def check_plan(plan: TeamPlan, budget: TeamBudget, jobs: list[TeamJob], capacity: dict[str, int | None]) -> None:
    horizon_h = budget.horizon_s / 3600.0
    assert plan.burn_usd_per_hour <= budget.max_usd_per_hour + EPS
    assert budget.spent_usd + plan.burn_usd_per_hour * horizon_h <= max(budget.total_usd, budget.spent_usd) + EPS
    by_name = {j.name: j for j in jobs}
    held: dict[str, int] = {}
    for a in plan.allotments:
        job = by_name[a.job]
        assert a.reason.strip(), a
        assert a.nodes == 0 or job.min_nodes <= a.nodes <= job.max_nodes, a
        if a.region is not None:
            held[a.region] = held.get(a.region, 0) + a.nodes
        if job.cap.max_usd_per_hour is not None:
            assert a.usd_per_hour <= job.cap.max_usd_per_hour + EPS, a
        if job.cap.total_usd is not None:
            assert job.spent_usd + a.usd_per_hour * horizon_h <= max(job.cap.total_usd, job.spent_usd) + EPS, a
        zero_kinds = {TeamActionKind.PAUSE, TeamActionKind.PAUSED, TeamActionKind.PENDING}
        assert (a.nodes == 0) == (a.kind in zero_kinds), a
        if a.kind is TeamActionKind.PAUSE:
            assert job.running and "checkpoint first" in a.reason
        if a.kind is TeamActionKind.MOVE:
            assert a.move_from == job.region and a.region != job.region
    for region, n in held.items():
        c = capacity.get(region)
        assert c is None or n <= c, (region, n, c)
    # Priority: a higher job gets nothing only if a lower job's allotment would not have helped.
    for hi in plan.allotments:
        if hi.nodes:
            continue
        h = by_name[hi.job]
        assert hi.region is not None
        need_usd = cost_usd_per_hour(h, hi.region, h.min_nodes)
        for lo in plan.allotments:
            low = by_name[lo.job]
            if low.priority >= h.priority or lo.nodes == 0:
                continue
            cap_left = plan.capacity_left.get(hi.region)
            freed = lo.nodes if lo.region == hi.region else 0
            assert (
                need_usd > plan.left_usd_per_hour + lo.usd_per_hour + EPS
                or need_usd > job_room_usd_per_hour(h, budget.horizon_s) + EPS
                or (cap_left is not None and h.min_nodes > cap_left + freed)
            ), (hi, lo, plan.left_usd_per_hour)


def check_holds(plan: TeamPlan, jobs: list[TeamJob], now: float) -> None:
    """Hysteresis: a paused job held back although its need fits says why, is never held once it
    has waited min_pause_s unless the total would not last, and no lower-priority job then runs."""
    by_name = {j.name: j for j in jobs}
    for a in plan.allotments:
        if "waits out the dip" not in a.reason and "would not keep" not in a.reason:
            continue
        job = by_name[a.job]
        assert a.kind is TeamActionKind.PAUSED and job.paused and job.paused_at is not None, a
        if now - job.paused_at >= 1800.0:
            assert "would not keep" in a.reason, a
        assert not any(o.nodes and by_name[o.job].priority < job.priority for o in plan.allotments), a


def apply(job: TeamJob, plan: TeamPlan, spent_job: float, factor: dict[str, float], now: float = 0.0) -> TeamJob:
    a = plan.of(job.name)
    offers = tuple(replace(o, node_price_per_hour=o.node_price_per_hour * factor[o.region]) for o in job.offers)
    if a.nodes == 0:
        paused_at = now if a.kind is TeamActionKind.PAUSE else job.paused_at
        return replace(job, node_prices=(), paused=job.placed, spent_usd=spent_job, offers=offers, paused_at=paused_at)
    assert a.region is not None
    kept = sorted(job.node_prices)[: a.nodes] if a.region == job.region and job.running else []
    offer = job.offer(a.region)
    assert offer is not None
    bought = [offer.node_price_per_hour] * (a.nodes - len(kept))
    # Prices move between passes: the next pass sees the new ones (spend used the old ones).
    moved = tuple(p * factor[a.region] for p in (*kept, *bought))
    return replace(job, region=a.region, node_prices=moved, paused=False, spent_usd=spent_job, offers=offers)


def interrupt(jobs: list[TeamJob], capacity: dict[str, int | None]) -> list[TeamJob]:
    """A capacity drop takes nodes away (lowest-named job first; EC2 does not know priorities)."""
    out = []
    left = dict(capacity)
    for job in sorted(jobs, key=lambda j: j.name):
        c = left.get(job.region or "")
        if job.region is None or c is None or not job.running:
            out.append(job)
            continue
        keep = min(len(job.node_prices), c)
        left[job.region] = c - keep
        out.append(replace(job, node_prices=job.node_prices[:keep]))
    return sorted(out, key=lambda j: j.name)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(runs())
def test_team_never_over_budget_and_priorities_hold(run: Run) -> None:
    jobs = list(run.jobs)
    spent, now = 0.0, 0.0
    for dt, capacity, factor in run.steps:
        jobs = interrupt(jobs, capacity)
        budget = TeamBudget(run.total_usd, run.max_usd_per_hour, spent, run.horizon_s)
        plan = allocate(budget, jobs, capacity, now=now)
        check_plan(plan, budget, jobs, capacity)
        check_holds(plan, jobs, now)
        spent += plan.burn_usd_per_hour * dt / 3600.0
        assert spent <= run.total_usd + EPS
        new = []
        for job in jobs:
            a = plan.of(job.name)
            job_spent = job.spent_usd + a.usd_per_hour * dt / 3600.0
            if job.cap.total_usd is not None:
                assert job_spent <= job.cap.total_usd + EPS
            new.append(apply(job, plan, job_spent, factor, now))
        jobs = new
        now += dt


@settings(max_examples=200, deadline=None, database=None)
@given(runs())
def test_allotment_costs_match_the_jobs_node_prices(run: Run) -> None:
    """The burn the plan allots is what the allotted nodes cost: kept nodes at their own price."""
    jobs = list(run.jobs)
    _, capacity, _ = run.steps[0]
    plan = allocate(TeamBudget(run.total_usd, run.max_usd_per_hour, 0.0, run.horizon_s), jobs, capacity)
    for job in jobs:
        a = plan.of(job.name)
        if a.nodes:
            assert a.region is not None
            assert abs(a.usd_per_hour - cost_usd_per_hour(job, a.region, a.nodes)) < EPS
    assert abs(plan.burn_usd_per_hour - sum(a.usd_per_hour for a in plan.allotments)) < EPS
