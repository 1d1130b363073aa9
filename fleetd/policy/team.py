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
3. Extras, by priority (higher first): nodes above the need, up to ``max_nodes``, one at a time.
   Within one priority they go to the job with the fewest nodes per node of ``min_nodes`` (ties
   by name): equal priorities share in proportion to their minimum sizes.
So when money or capacity is short, lower-priority jobs shrink to their need first, then pause;
a higher-priority job is never paused while a lower one runs unless its need could not be met
even with that lower job's whole allotment added back (or its region, which it leaves only when
a move pays, has no room). Paused jobs resume in step 2 as soon as their need fits, highest
priority first.

Pure: plain data in, a `TeamPlan` out; no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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


class _Pool:
    """What is left to hand out: team room (USD/h) and capacity per region."""

    def __init__(self, room: float, capacity: Mapping[str, int | None]) -> None:
        self.room = room
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
        c = self.capacity.get(g.placement.region)
        if c is not None:
            self.capacity[g.placement.region] = c - (nodes - g.nodes)
        g.nodes, g.usd = nodes, usd


def allocate(
    budget: TeamBudget,
    jobs: Sequence[TeamJob],
    capacity: Mapping[str, int | None],
    settings: TeamSettings | None = None,
) -> TeamPlan:
    """Allotments for every job. ``capacity``: nodes the team can hold per region now, its own
    included (a region not listed: unbounded)."""
    settings = settings or TeamSettings()
    if len({j.name for j in jobs}) != len(jobs):
        raise ValueError("job names must be unique")
    room = team_room_usd_per_hour(budget)
    pool = _Pool(room, capacity)
    grants: dict[str, _Grant] = {}
    for job in sorted(jobs, key=need_order):
        g = _Grant(job, place(job, pool.capacity, settings), job_room_usd_per_hour(job, budget.horizon_s))
        grants[job.name] = g
        for n in range(job.need(), job.min_nodes - 1, -1):  # a deadline ask: as much as fits
            why = pool.fits(g, n)
            if not why:
                pool.grant(g, n)
                break
            g.blocker = why
    for priority in sorted({j.priority for j in jobs}, reverse=True):
        _share_extras([g for g in grants.values() if g.job.priority == priority and g.nodes > 0], pool)
    allotments = tuple(_allotment(grants[j.name]) for j in jobs)
    burn = sum(a.usd_per_hour for a in allotments)
    forecast = budget.spent_usd + burn * budget.horizon_s / 3600.0
    reason = (
        f"team: spent ${budget.spent_usd:.2f} of ${budget.total_usd:.2f}; may burn ${room:.2f}/h "
        f"(max ${budget.max_usd_per_hour:.2f}/h, and ${max(0.0, budget.total_usd - budget.spent_usd):.2f} "
        f"left over {budget.horizon_s / 3600:g} h); allotted ${burn:.2f}/h, forecast ${forecast:.2f}"
    )
    return TeamPlan(allotments, room, burn, forecast, pool.room, dict(pool.capacity), reason)


def _share_extras(group: list[_Grant], pool: _Pool) -> None:
    """Step 3 for one priority: one node at a time to the fewest nodes per node of min_nodes."""
    active = [g for g in group if g.nodes < g.job.max_nodes]
    while active:
        g = min(active, key=lambda g: (g.nodes / g.job.min_nodes, g.job.name))
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
        need = f"its need of {job.need()} nodes does not fit {g.blocker}"
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
