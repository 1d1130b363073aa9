"""The ledger over time, for `fleetd report --plot`: spend so far, live nodes by market and the
training step at evenly spaced instants. Pure: the same billing function as every total
(fleetd.policy.ledger.bills) applied to the events known at each instant."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fleetd.policy.ledger import bills
from fleetd.policy.ledger_events import (
    BillsRolledUp,
    InstanceStarted,
    InstanceStopped,
    LedgerEvent,
    StepReached,
    StepsLost,
    TargetChanged,
)


@dataclass(frozen=True, slots=True)
class Timeline:
    times: tuple[float, ...]
    spend_usd: tuple[float, ...]
    nodes_by_market: dict[str, tuple[int, ...]]
    step: tuple[int, ...]  # useful progress: the highest step reached so far
    losses: tuple[StepsLost, ...]  # each resume below where the job was
    decisions: tuple[TargetChanged, ...]


def timeline(
    events: Iterable[LedgerEvent],
    now: float,
    observed_until: Mapping[str, float] | None = None,
    points: int = 200,
) -> Timeline:
    events = sorted(events, key=lambda e: e.at)
    observed_until = observed_until or {}
    starts = [e for e in events if isinstance(e, InstanceStarted)]
    if not starts:
        return Timeline((), (), {}, (), (), ())
    t0 = min(e.at for e in starts)
    stops = {e.instance_id: e.at for e in events if isinstance(e, InstanceStopped)}
    full = bills(events, now, observed_until)
    # Where each bill ends (its stop, or its last sighting): the last instant worth drawing.
    end_of = {b.instance_id: b.started_at + b.billed_seconds for b in full}
    t1 = max([*end_of.values(), *(e.at for e in events if e.at <= now), t0 + 1.0])
    n = max(2, points)
    times = tuple(t0 + (t1 - t0) * i / (n - 1) for i in range(n))
    spend, step_at = [], []
    markets = sorted({s.market.value for s in starts})
    nodes: dict[str, list[int]] = {m: [] for m in markets}
    progress = sorted((e.at, e.step) for e in events if isinstance(e, StepReached))
    for t in times:
        known = [e for e in events if e.at <= t]
        spend.append(
            sum(b.usd for b in bills(known, t, {k: min(v, t) for k, v in observed_until.items()}))
            + sum(e.usd for e in known if isinstance(e, BillsRolledUp))
        )  # compacted: at its time
        for m in markets:
            nodes[m].append(
                sum(
                    1
                    for s in starts
                    if s.market.value == m
                    and s.at <= t < min(stops.get(s.instance_id, float("inf")), end_of.get(s.instance_id, float("inf")))
                )
            )
        step_at.append(max((st for at, st in progress if at <= t), default=0))
    return Timeline(
        times,
        tuple(spend),
        {m: tuple(v) for m, v in nodes.items()},
        tuple(step_at),
        tuple(e for e in events if isinstance(e, StepsLost)),
        tuple(e for e in events if isinstance(e, TargetChanged)),
    )
