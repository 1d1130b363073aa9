"""What a scheduler that knew the whole trace in advance would pay: the reference the deadline
policies are measured against (bench/deadline.py, issue 34).

Offline dynamic programmes over time slots (``slot_s``, 60 s) and progress, with the prices and
the changeover ``d`` every policy in the sweep gets. Both are *lower bounds* on what any policy,
however clairvoyant, pays in the simulator, so a policy's gap to them is at most its gap to the
true optimum:

- spot capacity is counted per slot as the most nodes the trace offers at any moment of it (the
  simulator's policies lose a node the moment the trace removes it, and have to find capacity by
  asking for it);
- one node (``single_node``): exact otherwise. The node is idle, on spot or on on-demand; every
  start (after idling, a switch, or a spot node taken away) pays the changeover ``d`` billed at
  that market's price with no progress; progress survives a loss (Can't Be Late's model, which
  the sweep gives every policy). It cannot tell one spot node from another: staying on spot
  while any is offered is allowed, where the simulator's node may be the one removed;
- a fleet of N nodes (``fleet``): any k <= N nodes train in a slot (spot first, up to what is
  offered), ``k x efficiency(k)`` node-slots of work, with no changeover and no re-form at all.

Pure (numpy arrays in, dollars out); no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fleetd.sim.job import JobSpec
from fleetd.sim.traces import Trace

SLOT_S = 60.0
_INF = math.inf


def offered_per_slot(trace: Trace, slots: int, slot_s: float = SLOT_S) -> list[int]:
    """The most spot nodes the trace offers at any moment of each slot (an optimistic count)."""
    out = [trace.live_at(i * slot_s) for i in range(slots)]
    for ev in trace.events:
        i = int(ev.t // slot_s)
        if 0 <= i < slots:
            out[i] = max(out[i], trace.live_at(ev.t))
    return out


def single_node(
    offered: Sequence[int],
    work_slots: int,
    deadline_slots: int,
    changeover_slots: int,
    spot_price: float,
    on_demand_price: float,
    slot_s: float = SLOT_S,
) -> float | None:
    """The least a one-node job can pay to train ``work_slots`` slots by ``deadline_slots``
    (None: impossible even on on-demand). Prices per hour; the result in dollars."""
    p_spot, p_od = spot_price * slot_s / 3600.0, on_demand_price * slot_s / 3600.0
    n, boot = work_slots + 1, max(changeover_slots, 0)
    idle = np.full(n, _INF)
    idle[0] = 0.0
    run_spot, run_od = np.full(n, _INF), np.full(n, _INF)
    # boot_*[j]: held, j more changeover slots to pay before it trains (j = 1 .. boot - 1).
    boot_spot, boot_od = np.full((max(boot, 1), n), _INF), np.full((max(boot, 1), n), _INF)
    best = _INF
    for t in range(min(deadline_slots, len(offered))):
        ok = offered[t] >= 1
        # Releasing is free: any state can become idle (and start anew) at a slot's start.
        free = np.minimum.reduce([idle, run_od, boot_od.min(axis=0), run_spot, boot_spot.min(axis=0)])
        n_idle = free.copy()
        n_run_spot, n_run_od = np.full(n, _INF), np.full(n, _INF)
        n_boot_spot, n_boot_od = np.full_like(boot_spot, _INF), np.full_like(boot_od, _INF)
        for price, allowed, run, boots, n_run, n_boots in (
            (p_spot, ok, run_spot, boot_spot, n_run_spot, n_boot_spot),
            (p_od, True, run_od, boot_od, n_run_od, n_boot_od),
        ):
            if not allowed:
                continue  # a spot node is gone this slot: only the free states go on
            start = free + price
            if boot == 0:  # no changeover: a start trains at once
                n_run[1:] = np.minimum(n_run[1:], start[:-1])
            elif boot == 1:
                np.minimum(n_run, start, out=n_run)  # the one changeover slot is this one
            else:
                np.minimum(n_boots[boot - 1], start, out=n_boots[boot - 1])
            if boot >= 2:
                n_boots[1 : boot - 1] = np.minimum(n_boots[1 : boot - 1], boots[2:boot] + price)
                np.minimum(n_run, boots[1] + price, out=n_run)
            n_run[1:] = np.minimum(n_run[1:], run[:-1] + price)  # train one slot
        idle, run_spot, run_od, boot_spot, boot_od = n_idle, n_run_spot, n_run_od, n_boot_spot, n_boot_od
        done = min(run_spot[-1], run_od[-1], idle[-1])
        best = min(best, done)
        for arr in (idle, run_spot, run_od):
            arr[-1] = _INF  # finished: it pays nothing more
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
    trace: Trace, job: JobSpec, spot_price: float, on_demand_price: float, changeover_s: float
) -> float | None:
    """The omniscient reference for one start of one case (the window the job sees): exact (up to
    the relaxations above) for one node, the no-changeover bound for a fleet."""
    assert job.deadline_s is not None
    slots = math.ceil(job.deadline_s / SLOT_S)
    offered = offered_per_slot(trace, slots)
    if job.max_nodes == 1:
        work = math.ceil(job.total_steps / job.throughput(1) / SLOT_S - 1e-9)
        return single_node(offered, work, slots, round(changeover_s / SLOT_S), spot_price, on_demand_price)
    return fleet(offered, job, job.total_steps, slots, spot_price, on_demand_price)
