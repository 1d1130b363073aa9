"""What a scheduler that knew the whole trace in advance would pay: the reference the deadline
policies are measured against (bench/deadline.py).

Offline dynamic programmes over ``SLOT_S`` slots and progress, with every policy's prices and
changeover d: ``single_node``, the optimum on the slot grid; ``fleet``, a lower bound only (no
changeover, no re-form), so a policy's gap to it is overstated. Pure: lists and numpy arrays in,
dollars out (docs/DESIGN.md "Placement and deadlines").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fleetd.sim.job import JobSpec
from fleetd.sim.traces import ADD, Trace

# 3 minutes: every changeover in the sweep is a whole number of slots.
SLOT_S = 180.0
_INF = math.inf


def offered_per_slot(trace: Trace, slots: int, slot_s: float = SLOT_S) -> list[int]:
    """The most spot nodes the trace offers at any moment of each slot (an optimistic count)."""
    out = [trace.live_at(i * slot_s) for i in range(slots)]
    for ev in trace.events:
        i = int(ev.t // slot_s)
        if 0 <= i < slots:
            out[i] = max(out[i], trace.live_at(ev.t))
    return out


def spot_run_end(trace: Trace, slots: int, slot_s: float = SLOT_S, choose: str = "first") -> list[int]:
    """For each slot t: the last slot boundary a spot node started at t can be held to (released
    before its removal); t itself when none is offered. ``choose``: which offered node a start
    gets: "first", the one offered longest (the simulator's rule: EC2 picks the instance, not
    the job), or "longest", the one that will last longest (a choice no real job has: a bound)."""
    if choose not in ("first", "longest"):
        raise ValueError(f"choose must be 'first' or 'longest', not {choose!r}")
    lives: list[tuple[int, float, float]] = []  # (order offered, added, removed) per node life
    since: dict[str, tuple[int, float]] = {}
    for i, ev in enumerate(trace.events):
        if ev.kind == ADD:
            since[ev.node] = (i, ev.t)
        elif ev.node in since:
            order, added = since.pop(ev.node)
            lives.append((order, added, ev.t))
    lives += [(order, added, math.inf) for order, added in since.values()]  # never removed in the window
    out = []
    for t in range(slots):
        at = t * slot_s
        offered = sorted((order, end) for order, added, end in lives if added <= at < end)
        if not offered:
            out.append(t)
            continue
        last = offered[0][1] if choose == "first" else max(end for _, end in offered)
        out.append(slots if last == math.inf else max(t, min(slots, math.floor(last / slot_s))))
    return out


def single_node(
    run_end: Sequence[int],
    work_slots: int,
    deadline_slots: int,
    changeover_slots: int,
    spot_price: float,
    on_demand_price: float,
    slot_s: float = SLOT_S,
) -> float | None:
    """The least a one-node job pays to train ``work_slots`` slots by ``deadline_slots`` (None:
    impossible even on on-demand). ``run_end[t]``: how long a spot node started at slot t can run
    (``spot_run_end``). Prices per hour; the result in dollars. A state is (slot, progress) with
    no node held; a run (a start, ``changeover_slots`` of changeover, then training) goes from
    one such state to a later one, or to the end of the work."""
    prices = (spot_price * slot_s / 3600.0, on_demand_price * slot_s / 3600.0)
    work, horizon, d = work_slots, deadline_slots, changeover_slots
    free = np.full((horizon + 1, work), _INF)  # progress 0 .. work-1: not done yet
    free[0, 0] = 0.0
    left = np.arange(work, 0, -1)  # work left at each progress
    best = _INF
    for t in range(horizon):
        cur = free[t]
        if not np.isfinite(cur).any():
            continue
        np.minimum(free[t + 1], cur, out=free[t + 1])  # idle one slot
        for price, last in ((prices[0], min(run_end[t], horizon)), (prices[1], horizon)):
            if last <= t:
                continue  # no spot node offered now
            # Finish within this run: pay the changeover and the work left.
            fits = t + d + left <= last
            if fits.any():
                best = min(best, float((cur + price * (d + left))[fits].min()))
            # Or stop at a later boundary t2 with the progress made (a loss, a switch, a pause).
            for t2 in range(t + d + 1, last + 1):
                gain = t2 - t - d
                if gain >= work:
                    break
                np.minimum(free[t2, gain:], cur[: work - gain] + price * (t2 - t), out=free[t2, gain:])
    return None if best == _INF else best


def fleet(
    offered: Sequence[int],
    job: JobSpec,
    work_steps: float,
    deadline_slots: int,
    spot_price: float,
    on_demand_price: float,
    slot_s: float = SLOT_S,
    resolution: int = 4,
) -> float | None:
    """A lower bound on what an N-node job pays to train ``work_steps`` by the deadline: each slot
    any k <= N nodes train (spot first), no changeover, no re-form. Progress is counted in
    1/``resolution`` of one node's slot, each slot's gain rounded up (so it stays a bound)."""
    unit = job.throughput(1) * slot_s / resolution
    need = math.ceil(work_steps / unit - 1e-9)
    cost = np.full(need + 1, _INF)
    cost[0] = 0.0
    best = _INF
    gains = [math.ceil(job.throughput(k) * slot_s / unit - 1e-9) for k in range(job.max_nodes + 1)]
    for t in range(min(deadline_slots, len(offered))):
        nxt = cost.copy()  # nobody trains this slot
        for k in range(1, job.max_nodes + 1):
            spot = min(k, offered[t])
            price = (spot * spot_price + (k - spot) * on_demand_price) * slot_s / 3600.0
            g = gains[k]
            if g >= need:
                best = min(best, float(cost.min()) + price)  # a done job pays no more
                continue
            nxt[g:] = np.minimum(nxt[g:], cost[:-g] + price)
            # Reaching the end from anywhere within one slot's gain of it.
            best = min(best, float(cost[need - g :].min()) + price)
        nxt[need] = _INF
        cost = nxt
    return None if best == _INF else best


def reference(
    trace: Trace, job: JobSpec, spot_price: float, on_demand_price: float, changeover_s: float, choose: str = "first"
) -> float | None:
    """The omniscient reference for one start of one case (the window the job sees): the optimum
    on the slot grid for one node (``choose``: see ``spot_run_end``), the no-changeover bound for
    a fleet."""
    assert job.deadline_s is not None
    slots = math.ceil(job.deadline_s / SLOT_S - 1e-9)
    if job.max_nodes == 1:
        work = math.ceil(job.total_steps / job.throughput(1) / SLOT_S - 1e-9)
        return single_node(
            spot_run_end(trace, slots, choose=choose),
            work,
            slots,
            round(changeover_s / SLOT_S),
            spot_price,
            on_demand_price,
        )
    return fleet(offered_per_slot(trace, slots), job, job.total_steps, slots, spot_price, on_demand_price)
