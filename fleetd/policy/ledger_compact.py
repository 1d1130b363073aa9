"""Compaction of the ledger's per-pass rows: the report's totals stay exact, the table stops
growing with every pass.

Two kinds of event are written per pass, not per decision: ``StepReached`` (every pass with
progress: 8,640 a day at a 10 s interval) and ``IdleGpuTime`` (every idle billed node, every
pass). Older than the horizon they are rolled up:

- ``StepReached``: per ``step_every_s`` bucket only the highest step is kept. The report counts
  the highest step ever reached (kept: it is the highest of its bucket), a restarted daemon
  resumes from it, and the plot's step curve keeps that resolution;
- ``IdleGpuTime``: one event per instance, at its newest time, with the sum of its
  accelerator-seconds (the report's ``idle_gpu_s`` is their sum).

Everything else (billing, prices, losses, recoveries, scaling decisions) is kept as it is:
those are one row per decision or per launch, and the spend is computed from them.
Pure: the store (fleetd.reconcile.ledger_store) applies the result in one transaction.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fleetd.policy.ledger_events import IdleGpuTime, LedgerEvent, StepReached

STEP_EVERY_S = 600.0


@dataclass(frozen=True, slots=True)
class Compaction:
    drop: tuple[LedgerEvent, ...]  # each carries its event_id (the store deletes by it)
    add: tuple[LedgerEvent, ...]

    @property
    def empty(self) -> bool:
        return not self.drop and not self.add


def compact(events: Iterable[LedgerEvent], before: float, step_every_s: float = STEP_EVERY_S) -> Compaction:
    """What to drop and add so that events older than ``before`` take one row per bucket (steps)
    or per instance (idle time). Only events with an ``event_id`` are touched (the store
    deletes by it); compacting an already compacted ledger changes nothing."""
    best_step: dict[int, StepReached] = {}
    steps: list[StepReached] = []
    idle: dict[str, list[IdleGpuTime]] = {}
    for e in events:
        if e.at >= before or not e.event_id:
            continue
        if isinstance(e, StepReached):
            steps.append(e)
            bucket = int(e.at // step_every_s)
            kept = best_step.get(bucket)
            if kept is None or (e.step, e.at) > (kept.step, kept.at):
                best_step[bucket] = e
        elif isinstance(e, IdleGpuTime):
            idle.setdefault(e.instance_id, []).append(e)
    keep = {id(e) for e in best_step.values()}
    drop: list[LedgerEvent] = [e for e in steps if id(e) not in keep]
    add: list[LedgerEvent] = []
    for iid, rows in sorted(idle.items()):
        if len(rows) < 2:
            continue
        last = max(rows, key=lambda r: r.at)
        total = 0.0
        for r in sorted(rows, key=lambda r: r.at):  # a fixed order: the same sum on every host
            total += r.gpu_seconds
        drop += rows
        add.append(IdleGpuTime(at=last.at, instance_id=iid, gpu_seconds=total,
                               event_id=f"idle-rollup:{iid}:{last.at:.3f}:{len(rows)}"))
    return Compaction(tuple(drop), tuple(add))
