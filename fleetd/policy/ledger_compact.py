"""Compaction of the ledger's per-pass rows: the report's totals stay exact, the table stops
growing with every pass.

Older than the horizon (``before``): a stopped instance's rows become its share of one
``BillsRolledUp``; ``StepReached`` keeps the highest step per ``step_every_s`` bucket; a running
instance's ``IdleGpuTime`` becomes one sum. Prices, lost steps, recoveries and scaling decisions
stay one row each. Pure: fleetd.reconcile.ledger_store applies the result in one transaction
(docs/DESIGN.md "Budget semantics").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fleetd.policy.ledger import bills
from fleetd.policy.ledger_events import (
    BillsRolledUp,
    IdleGpuTime,
    InstancePlaced,
    InstanceStarted,
    InstanceStopped,
    Interruption,
    LedgerEvent,
    StepReached,
)

PER_INSTANCE = (InstanceStarted, InstancePlaced, InstanceStopped, Interruption, IdleGpuTime)

STEP_EVERY_S = 600.0


@dataclass(frozen=True, slots=True)
class Compaction:
    drop: tuple[LedgerEvent, ...]  # each carries its event_id (the store deletes by it)
    add: tuple[LedgerEvent, ...]

    @property
    def empty(self) -> bool:
        return not self.drop and not self.add


def compact(events: Iterable[LedgerEvent], before: float, step_every_s: float = STEP_EVERY_S) -> Compaction:
    """What to drop and add so that events older than ``before`` take one row per compaction
    (ended instances), per bucket (steps) or per instance (idle time of running ones). Only
    events with an ``event_id`` are dropped (the store deletes by it); compacting an already
    compacted ledger changes nothing."""
    events = list(events)
    drop: list[LedgerEvent] = []
    add: list[LedgerEvent] = []
    # Ended instances: every row of theirs is older than the horizon and has an event_id.
    # A stopped instance's bill no longer changes (later prices do not touch it), so the report's sums
    # stay exact; only its per-instance lines and its place in pool_history go (the daemon's pool
    # statistics live in the state DB).
    stopped = {e.instance_id for e in events if isinstance(e, InstanceStopped) and e.at < before}
    rows: dict[str, list[LedgerEvent]] = {}
    for e in events:
        if isinstance(e, PER_INSTANCE):
            rows.setdefault(e.instance_id, []).append(e)
    ended = sorted(
        iid
        for iid in stopped
        if all(r.at < before and r.event_id for r in rows[iid])
        and any(isinstance(r, InstanceStarted) for r in rows[iid])
    )
    if ended:
        wanted = set(ended)
        done = [b for b in bills(events, before) if b.instance_id in wanted]
        by_market: dict[str, float] = {}
        by_pool: dict[str, float] = {}
        for b in done:
            by_market[b.market.value] = by_market.get(b.market.value, 0.0) + b.usd
            by_pool[str(b.pool)] = by_pool.get(str(b.pool), 0.0) + b.usd
        gone = [r for iid in ended for r in rows[iid]]
        drop += gone
        at = max(r.at for r in gone)
        add.append(
            BillsRolledUp(
                at=at,
                instances=len(done),
                billed_seconds=sum(b.billed_seconds for b in done),
                usd=sum(b.usd for b in done),
                on_demand_usd=sum(b.on_demand_equivalent_usd for b in done),
                usd_by_market=by_market,
                usd_by_pool=by_pool,
                idle_gpu_s=sum(r.gpu_seconds for r in gone if isinstance(r, IdleGpuTime)),
                notices=sum(1 for r in gone if isinstance(r, Interruption) and r.kind == "notice"),
                losses=sum(1 for r in gone if isinstance(r, Interruption) and r.kind == "loss"),
                event_id=f"rollup:{at:.3f}:{len(done)}:{ended[0]}",
            )
        )
    rolled = set(ended)
    best_step: dict[int, StepReached] = {}
    steps: list[StepReached] = []
    idle: dict[str, list[IdleGpuTime]] = {}
    for e in events:
        if e.at >= before or not e.event_id:
            continue
        if isinstance(e, StepReached):
            steps.append(e)
            # One row per pass with progress (8,640 a day at 10 s); the report and a restarted daemon need
            # only the highest step, so the highest of each bucket is kept.
            bucket = int(e.at // step_every_s)
            kept = best_step.get(bucket)
            if kept is None or (e.step, e.at) > (kept.step, kept.at):
                best_step[bucket] = e
        elif isinstance(e, IdleGpuTime) and e.instance_id not in rolled:
            idle.setdefault(e.instance_id, []).append(e)
    keep = {id(e) for e in best_step.values()}
    drop += [e for e in steps if id(e) not in keep]
    for iid, mine in sorted(idle.items()):
        if len(mine) < 2:
            continue
        last = max(mine, key=lambda r: r.at)
        total = 0.0
        for r in sorted(mine, key=lambda r: r.at):  # a fixed order: the same sum on every host
            total += r.gpu_seconds
        drop += mine
        add.append(
            IdleGpuTime(
                at=last.at, instance_id=iid, gpu_seconds=total, event_id=f"idle-rollup:{iid}:{last.at:.3f}:{len(mine)}"
            )
        )
    return Compaction(tuple(drop), tuple(add))
