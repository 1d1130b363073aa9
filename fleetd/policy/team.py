"""The team allocator (issue 33): one budget over many jobs, by priority, fair within a priority.

``allocate(budget, jobs, capacity, settings)`` gives every job an `Allotment` (nodes, region, the
USD per hour it may burn) and one action with its reason. Each job's own planner then runs inside
its allotment (its ``max_nodes`` and ``budget.max_usd_per_hour`` become the allotment's).

Rules, in order:
1. Room. The team may burn ``room = min(max_usd_per_hour, (total_usd - spent_usd) / horizon_h)``:
   spent plus the allotted burn over the horizon never crosses ``total_usd`` and the burn never
   crosses ``max_usd_per_hour`` (the never-over-budget invariant, for the sum over jobs). A job
   with a cap gets at most ``min(cap.max_usd_per_hour, (cap.total_usd - its spend) / horizon_h)``.
2. Needs, by priority (higher first). Each job's need is ``min_nodes`` (a deadline job's: what its
   deadline rule asks, at least ``min_nodes``, and if the whole ask does not fit, as much of it
   as fits). Within one priority: deadline jobs, then jobs already running (no churn), then the
   smaller need, then the name. A job is placed (``team_region.place``) when its turn comes, with
   the capacity the jobs before it left. A need that does not fit the room, its own cap or its
   region's capacity gets nothing: PENDING, PAUSE (checkpoint first) or PAUSED, with the blocker.
   A deadline ask above ``min_nodes`` never pauses a running lower-priority job: it leaves room
   for their minimums (a dip shrinks, it does not pause) and gets the rest of its ask from what
   the minimums left, before any extra.
3. Extras by marginal value: one node at a time to the job whose next node adds the most useful
   node-equivalents per USD/h (``TeamJob.useful_nodes``, its scaling model), and only while that
   node is worth its price by the job's own scaling rule (``scaling.marginal_efficiency`` >=
   ``min_marginal_efficiency``; a node it has is judged at its average price with the hysteresis,
   as scaling.py's scale-down). Priority weighs in only within ``extra_priority_band`` (30 %): the
   highest-priority job whose next node adds at least 70 % of the best on offer goes first; ties
   by value, then the fewest nodes per ``min_nodes`` (equal priorities share by their minimums).
   Why a band and not ties only: money a lower job's extras burn is gone for the higher job's
   remaining work when the total binds (measured: with a 10 % band prod misses its deadline on
   p3); outside the band one job's step is so much dearer that the money goes to the cheap one.
4. Resume hysteresis (``now`` is the caller's clock, against ``TeamJob.paused_at``). A paused job
   whose need fits still waits (PAUSED, "waits ...") when (a) the team's total left would not keep
   the burn allotted so far plus its need for the horizon plus twice its changeover; or, paused
   under ``min_pause_s`` (30 min), (b) a higher-priority job in its region was paused (now or under
   ``min_pause_s`` ago): that room is expected back, or (c) its need fits without
   ``resume_margin`` (50 %) to spare in USD/h and nodes. A held job is released, and the pass rerun,
   whenever a lower-priority job would run meanwhile: priority wins over hysteresis.
So when money or capacity is short, lower-priority jobs shrink to their need first, then pause;
a higher-priority job is never paused while a lower one runs unless its need could not be met
even with that lower job's whole allotment added back (or its region, which it leaves only when
a move pays, has no room).

Pure: plain data in, a `TeamPlan` out; no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from fleetd.policy.scaling import marginal_efficiency
from fleetd.policy.team_model import (
    Allotment,
    TeamActionKind,
    TeamBudget,
    TeamJob,
    TeamPlan,
    TeamSettings,
)
from fleetd.policy.team_region import Placement, capacity_of, cost_usd_per_hour, place

_EPS = 1e-9


def team_room_usd_per_hour(budget: TeamBudget) -> float:
    horizon_h = budget.horizon_s / 3600.0
    return max(0.0, min(budget.max_usd_per_hour, (budget.total_usd - budget.spent_usd) / horizon_h))


def job_room_usd_per_hour(job: TeamJob, horizon_s: float) -> float:
    room = math.inf
    if job.cap.max_usd_per_hour is not None:
        room = job.cap.max_usd_per_hour
    if job.cap.total_usd is not None:
        room = min(room, (job.cap.total_usd - job.spent_usd) / (horizon_s / 3600.0))
    return max(0.0, room)


def need_order(job: TeamJob) -> tuple[int, bool, bool, int, str]:
    """The order of step 2: priority, then deadline, running, smaller need, name."""
    return (-job.priority, job.deadline_nodes is None, not job.running, job.need(), job.name)


@dataclass
class _Grant:
    job: TeamJob
    placement: Placement
    own_room: float
    nodes: int = 0
    usd: float = 0.0
    blocker: str = ""
    held: str = ""  # why a paused job whose need fits stays paused (step 4)


class _Pool:
    """What is left to hand out: team room (USD/h) and capacity per region."""

    def __init__(self, room: float, capacity: Mapping[str, int | None]) -> None:
        self.room = room
        self.burn = 0.0  # allotted so far
        self.capacity: dict[str, int | None] = dict(capacity)

    def fits(self, g: _Grant, nodes: int) -> str:
        """Why ``nodes`` nodes do not fit for ``g`` ('' when they do)."""
        region = g.placement.region
        extra = nodes - g.nodes
        usd = cost_usd_per_hour(g.job, region, nodes)
        if usd - g.usd > self.room + _EPS:
            return f"the team budget: ${usd:.2f}/h needed, ${self.room + g.usd:.2f}/h left"
        if usd > g.own_room + _EPS:
            return f"its own cap: ${usd:.2f}/h needed, its cap allows ${g.own_room:.2f}/h"
        if extra > capacity_of(self.capacity, region):
            return f"capacity: {region} has room for {capacity_of(self.capacity, region):g} more nodes"
        return ""

    def grant(self, g: _Grant, nodes: int) -> None:
        usd = cost_usd_per_hour(g.job, g.placement.region, nodes)
        self.room -= usd - g.usd
        self.burn += usd - g.usd
        c = self.capacity.get(g.placement.region)
        if c is not None:
            self.capacity[g.placement.region] = c - (nodes - g.nodes)
        g.nodes, g.usd = nodes, usd


def allocate(
    budget: TeamBudget,
    jobs: Sequence[TeamJob],
    capacity: Mapping[str, int | None],
    settings: TeamSettings | None = None,
    *,
    now: float | None = None,
) -> TeamPlan:
    """Allotments for every job. ``capacity``: nodes the team can hold per region now, its own
    included (a region not listed: unbounded). ``now``: the caller's clock, against each job's
    ``paused_at`` (None: no paused job is held back for time)."""
    settings = settings or TeamSettings()
    if len({j.name for j in jobs}) != len(jobs):
        raise ValueError("job names must be unique")
    room = team_room_usd_per_hour(budget)
    released: set[str] = set()
    while True:  # at most one more pass per held job
        pool, grants = _pass(budget, jobs, capacity, settings, now, released)
        late = {g.job.name for g in grants.values() if g.held and _lower_runs(g, grants.values())}
        if not late:
            break
        released |= late
    allotments = tuple(_allotment(grants[j.name]) for j in jobs)
    burn = sum(a.usd_per_hour for a in allotments)
    forecast = budget.spent_usd + burn * budget.horizon_s / 3600.0
    reason = (
        f"team: spent ${budget.spent_usd:.2f} of ${budget.total_usd:.2f}; may burn ${room:.2f}/h "
        f"(max ${budget.max_usd_per_hour:.2f}/h, and ${max(0.0, budget.total_usd - budget.spent_usd):.2f} "
        f"left over {budget.horizon_s / 3600:g} h); allotted ${burn:.2f}/h, forecast ${forecast:.2f}"
    )
    return TeamPlan(allotments, room, burn, forecast, pool.room, dict(pool.capacity), reason)


def _pass(
    budget: TeamBudget,
    jobs: Sequence[TeamJob],
    capacity: Mapping[str, int | None],
    settings: TeamSettings,
    now: float | None,
    released: set[str],
) -> tuple[_Pool, dict[str, _Grant]]:
    """Steps 2 and 3; a paused job not in ``released`` may be held back (step 4)."""
    pool = _Pool(team_room_usd_per_hour(budget), capacity)
    grants: dict[str, _Grant] = {}
    order = sorted(jobs, key=need_order)
    for i, job in enumerate(order):
        g = _Grant(job, place(job, pool.capacity, settings), job_room_usd_per_hour(job, budget.horizon_s))
        grants[job.name] = g
        keep = [o for o in order[i + 1 :] if o.running and o.priority < job.priority]
        for n in range(job.need(), job.min_nodes - 1, -1):  # a deadline ask: as much as fits
            why = pool.fits(g, n) or (_reserve_short(g, n, keep, pool) if n > job.min_nodes else "")
            if not why:
                if job.name not in released:
                    g.held = resume_hold(job, g.placement.region, n, pool, budget, settings, now)
                    g.held = g.held or _room_of_a_higher(g, grants.values(), settings, now)
                if not g.held:
                    pool.grant(g, n)
                break
            g.blocker = why
    for g in grants.values():  # the rest of a deadline ask, from what the minimums left
        for n in range(g.job.need(), g.nodes, -1):
            if g.nodes and not pool.fits(g, n):
                pool.grant(g, n)
                break
    _share_extras(list(grants.values()), pool, settings.extra_priority_band)
    return pool, grants


def _room_of_a_higher(g: _Grant, grants: Iterable[_Grant], settings: TeamSettings, now: float | None) -> str:
    """Step 4's last rule: a paused job paused under ``min_pause_s`` does not resume into room a
    higher-priority job in its region left less than ``min_pause_s`` ago: that room is expected back."""
    job = g.job
    if not job.paused or now is None or job.paused_at is None or now - job.paused_at >= settings.min_pause_s:
        return ""
    for o in grants:
        oj = o.job
        recent = oj.running or (oj.paused and oj.paused_at is not None and now - oj.paused_at < settings.min_pause_s)
        if o.nodes == 0 and oj.priority > job.priority and o.placement.region == g.placement.region and recent:
            return f"waits out the dip: the room is {oj.name}'s (priority {oj.priority}), paused under {settings.min_pause_s / 60:g} min ago"
    return ""


def _reserve_short(g: _Grant, nodes: int, keep: list[TeamJob], pool: _Pool) -> str:
    """Why a deadline ask of ``nodes`` above ``min_nodes`` would pause a running lower job ('' if not)."""
    region = g.placement.region
    usd = sum(cost_usd_per_hour(o, o.region or "", o.min_nodes) for o in keep)
    here = sum(o.min_nodes for o in keep if o.region == region)
    extra_usd = cost_usd_per_hour(g.job, region, nodes) - g.usd
    if extra_usd + usd > pool.room + _EPS or nodes - g.nodes + here > capacity_of(pool.capacity, region):
        return "the minimums of the running lower-priority jobs (a deadline ask above min_nodes pauses none)"
    return ""


def _lower_runs(g: _Grant, grants: Iterable[_Grant]) -> bool:
    return any(o.nodes > 0 and o.job.priority < g.job.priority for o in grants)


def resume_hold(
    job: TeamJob,
    region: str,
    nodes: int,
    pool: _Pool,
    budget: TeamBudget,
    settings: TeamSettings,
    now: float | None,
) -> str:
    """Why paused ``job`` waits although ``nodes`` fit ('' when it resumes): step 4."""
    if not job.paused or now is None or job.paused_at is None:
        return ""
    usd = cost_usd_per_hour(job, region, nodes)
    burn, left = pool.burn + usd, budget.total_usd - budget.spent_usd
    lasting_h = budget.horizon_s / 3600.0 + 2 * settings.changeover_h
    if burn * lasting_h > left + _EPS:
        return (
            f"waits: the team's ${max(0.0, left):.2f} left would not keep ${burn:.2f}/h (its need included) "
            f"for the {budget.horizon_s / 3600:g} h horizon plus twice its changeover"
        )
    paused_s = now - job.paused_at
    if paused_s >= settings.min_pause_s:
        return ""
    spare_usd, spare_nodes = pool.room - usd, capacity_of(pool.capacity, region) - nodes
    if spare_usd + _EPS >= settings.resume_margin * usd and spare_nodes >= math.ceil(settings.resume_margin * nodes):
        return ""
    return (
        f"waits out the dip: its {nodes} nodes fit but without {settings.resume_margin:.0%} to spare "
        f"(${max(0.0, spare_usd):.2f}/h and {spare_nodes:g} nodes left in {region}), paused "
        f"{paused_s / 60:.0f} of {settings.min_pause_s / 60:g} min"
    )


def next_node_value(job: TeamJob, region: str, nodes: int, usd: float) -> tuple[float, str]:
    """Useful node-equivalents per USD/h that node ``nodes + 1`` adds, and '' if it is worth its
    price by the job's own scaling rule (scaling.py: >= min_marginal_efficiency of its average per
    dollar), else why not."""
    price = cost_usd_per_hour(job, region, nodes + 1) - usd
    gain = job.useful(nodes + 1) - job.useful(nodes)
    if price <= _EPS:
        return math.inf, ""
    bar = job.min_marginal_efficiency
    if job.useful(nodes) <= _EPS:  # nothing useful yet: any gain is worth it
        return (gain / price, "") if gain > _EPS else (0.0, f"its scaling: node {nodes + 1} adds nothing useful")
    if job.running and region == job.region and nodes < len(job.node_prices):
        # a node it has: judged as scaling.py's scale-down, at its average price, with hysteresis
        avg = sum(job.node_prices) / len(job.node_prices)
        eff, bar = marginal_efficiency(gain, avg, job.useful(nodes), nodes * avg), bar * (1 - job.efficiency_hysteresis)
    else:
        eff = marginal_efficiency(gain, price, job.useful(nodes), usd)
    if eff + _EPS >= bar:
        return gain / price, ""
    return gain / price, (
        f"its scaling: node {nodes + 1} adds {gain:.2f} node-equivalents for ${price:.2f}/h, {eff:.0%} of "
        f"its average per dollar < {bar:.0%} (min_marginal_efficiency {job.min_marginal_efficiency:.0%})"
    )


def _share_extras(grants: list[_Grant], pool: _Pool, band: float) -> None:
    """Step 3: one node at a time, where it adds most useful work per dollar (priority within band)."""
    active = [g for g in grants if 0 < g.nodes < g.job.max_nodes]
    while active:
        offers = []
        for g in list(active):
            value, not_worth = next_node_value(g.job, g.placement.region, g.nodes, g.usd)
            if not_worth:
                g.blocker = not_worth
                active.remove(g)
            else:
                offers.append((value, g))
        if not offers:
            return
        best = max(v for v, _ in offers)
        near = [(v, g) for v, g in offers if v >= (1 - band) * best - _EPS]
        _, g = min(near, key=lambda o: (-o[1].job.priority, -o[0], o[1].nodes / o[1].job.min_nodes, o[1].job.name))
        why = pool.fits(g, g.nodes + 1)
        if why:
            g.blocker = why
            active.remove(g)
            continue
        pool.grant(g, g.nodes + 1)
        if g.nodes >= g.job.max_nodes:
            active.remove(g)


def _allotment(g: _Grant) -> Allotment:
    job, p = g.job, g.placement
    head = f"priority {job.priority}"
    where = p.note
    if g.nodes == 0:
        need = g.held or f"its need of {job.need()} nodes does not fit {g.blocker}"
        if job.running:
            kind, verb = TeamActionKind.PAUSE, "paused, checkpoint first"
        elif job.paused:
            kind, verb = TeamActionKind.PAUSED, "stays paused"
        else:
            kind, verb = TeamActionKind.PENDING, "pending"
        return Allotment(job.name, kind, 0, p.region, 0.0, f"{verb} ({head}): {need}; {where}")
    current = len(job.node_prices) if job.running else 0
    share = f"{g.nodes} nodes (need {job.need()}, wants {job.max_nodes}) at ${g.usd:.2f}/h"
    if g.nodes < job.max_nodes:
        share += f"; more does not fit {g.blocker or 'its need'}"
    if job.deadline_nodes is not None and g.nodes < job.need():
        share += f"; its deadline rule asks {job.need()}: deadline at risk"
    if p.moved_from is not None and job.placed:
        kind = TeamActionKind.MOVE
    elif not job.placed:
        kind = TeamActionKind.START
    elif job.paused:
        kind = TeamActionKind.RESUME
    elif g.nodes > current:
        kind = TeamActionKind.GROW
    elif g.nodes < current:
        kind = TeamActionKind.SHRINK
    else:
        kind = TeamActionKind.KEEP
    return Allotment(job.name, kind, g.nodes, p.region, g.usd, f"{kind.value} ({head}): {share}; {where}", p.moved_from)
