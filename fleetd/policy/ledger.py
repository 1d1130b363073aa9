"""The spend and goodput ledger: pure functions over an ordered list of events.

Billing model (EC2 Linux): each instance accrues per second at the price in force for its pool and
market, from launch to stop, with a 60 s minimum per launch. A price change applies from its
timestamp to every running instance of that pool and market. The same billed seconds at the
pool's on-demand price give the on-demand equivalent (what the run would have cost without spot).

The events are the persisted truth (fleetd.reconcile.ledger_store): a restarted fleetd re-reads them
and recomputes exactly the same totals. Times are seconds on the caller's clock.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

# Re-exported (explicitly, `X as X`): callers use ledger.<Event>.
from fleetd.policy.ledger_events import EVENT_KINDS as EVENT_KINDS
from fleetd.policy.ledger_events import EVENT_TYPES as EVENT_TYPES
from fleetd.policy.ledger_events import BillsRolledUp as BillsRolledUp
from fleetd.policy.ledger_events import IdleGpuTime as IdleGpuTime
from fleetd.policy.ledger_events import InstancePlaced as InstancePlaced
from fleetd.policy.ledger_events import InstanceStarted as InstanceStarted
from fleetd.policy.ledger_events import InstanceStopped as InstanceStopped
from fleetd.policy.ledger_events import Interruption as Interruption
from fleetd.policy.ledger_events import JobStateChanged as JobStateChanged
from fleetd.policy.ledger_events import LedgerEvent as LedgerEvent
from fleetd.policy.ledger_events import PriceChanged as PriceChanged
from fleetd.policy.ledger_events import RecoveryTime as RecoveryTime
from fleetd.policy.ledger_events import StepReached as StepReached
from fleetd.policy.ledger_events import StepsLost as StepsLost
from fleetd.policy.ledger_events import StepsRegained as StepsRegained
from fleetd.policy.ledger_events import TargetChanged as TargetChanged
from fleetd.policy.model import Market, PoolId, PoolOffer
from fleetd.policy.observation import PoolStats

MINIMUM_CHARGE_S = 60.0  # EC2 Linux: per second, 60 s minimum per launch


@dataclass(frozen=True, slots=True)
class InstanceBill:
    instance_id: str
    pool: PoolId
    market: Market
    started_at: float
    stopped_at: float | None
    billed_seconds: float
    usd: float
    on_demand_equivalent_usd: float
    # No stop is recorded: billed up to when fleetd last saw it alive (observed_until), not to now.
    end_unseen: bool = False


@dataclass(frozen=True, slots=True)
class LedgerSummary:
    spend_usd: float
    on_demand_equivalent_usd: float
    savings_pct: float
    spend_by_market: dict[str, float]
    spend_by_pool: dict[str, float]
    node_seconds: float
    useful_steps: int
    steps_lost: int
    recovery_s: float
    idle_gpu_s: float
    usd_per_1k_steps: float | None  # None until a useful step exists
    instances: tuple[InstanceBill, ...] = field(default=())
    scaling: tuple[TargetChanged, ...] = field(default=())
    rolled_up_instances: int = 0  # ended instances whose bills compaction summed (BillsRolledUp)

    @property
    def end_unseen(self) -> tuple[InstanceBill, ...]:
        return tuple(b for b in self.instances if b.end_unseen)

    def as_json(self) -> dict[str, Any]:
        return {
            "spend_usd": round(self.spend_usd, 6),
            "on_demand_equivalent_usd": round(self.on_demand_equivalent_usd, 6),
            "savings_pct": round(self.savings_pct, 3),
            "spend_by_market": {k: round(v, 6) for k, v in sorted(self.spend_by_market.items())},
            "spend_by_pool": {k: round(v, 6) for k, v in sorted(self.spend_by_pool.items())},
            "node_seconds": round(self.node_seconds, 3),
            "useful_steps": self.useful_steps,
            "steps_lost": self.steps_lost,
            "recovery_s": round(self.recovery_s, 3),
            "idle_gpu_s": round(self.idle_gpu_s, 3),
            "usd_per_1k_steps": None if self.usd_per_1k_steps is None else round(self.usd_per_1k_steps, 6),
            "instances": len(self.instances) + self.rolled_up_instances,
            # Nodes whose end fleetd never saw (it stopped first): billed up to their last sighting.
            "instances_end_unseen": [
                {
                    "instance_id": b.instance_id,
                    "pool": str(b.pool),
                    "billed_until": round(b.started_at + b.billed_seconds, 3),
                }
                for b in self.end_unseen
            ],
            "scaling_decisions": [
                {"at": round(t.at, 3), "from": t.previous, "to": t.target, "reason": t.reason} for t in self.scaling
            ],
        }


def _ordered(events: Iterable[LedgerEvent]) -> list[LedgerEvent]:
    # Stable: events at the same timestamp keep the order they were recorded in.
    return sorted(events, key=lambda e: e.at)


class _PricePath:
    """One pool's price changes on one market, with a running integral so that the cost of any
    interval is two binary searches, not a walk over every change (thousands of nodes x
    thousands of price changes in a long run)."""

    def __init__(self, changes: list[tuple[float, float]]):
        self.times = [t for t, _ in changes]
        self.prices = [p for _, p in changes]
        self.cumulative = [0.0]  # USD-seconds/3600 from times[0] to times[i]
        for i in range(1, len(changes)):
            step = self.prices[i - 1] * (self.times[i] - self.times[i - 1]) / 3600.0
            self.cumulative.append(self.cumulative[-1] + step)

    def _from_first(self, t: float) -> float:
        """Integral from times[0] to t (t >= times[0])."""
        i = bisect.bisect_right(self.times, t) - 1
        return self.cumulative[i] + self.prices[i] * (t - self.times[i]) / 3600.0

    def integrate(self, start: float, end: float, initial: float) -> float:
        """USD over [start, end]: ``initial`` USD/h until the first change after ``start``."""
        first = bisect.bisect_right(self.times, start)  # first change strictly after start
        if first == len(self.times) or self.times[first] >= end:
            return initial * (end - start) / 3600.0
        switch = self.times[first]
        return initial * (switch - start) / 3600.0 + self._from_first(end) - self._from_first(switch)


_NO_CHANGES = _PricePath([])


class Charge(NamedTuple):
    billed_s: float
    usd: float


def charge(started_at: float, until: float, usd_per_hour: float, prices: _PricePath = _NO_CHANGES) -> Charge:
    """What one instance owes: the one definition of what a node costs (the daemon's spend, the
    reports and the simulator all bill through it). Launched at ``started_at``, billed to
    ``until`` (its stop, or now while it runs) per second at ``usd_per_hour``, or along
    ``prices`` (its pool's price changes) from the first change after launch. The 60 s minimum is
    charged from launch: a launch commits it, so a node younger than a minute already owes it."""
    end = max(until, started_at + MINIMUM_CHARGE_S)
    return Charge(end - started_at, prices.integrate(started_at, end, usd_per_hour))


def bills(
    events: Iterable[LedgerEvent], now: float, observed_until: Mapping[str, float] | None = None
) -> list[InstanceBill]:
    """One bill per launched instance; running instances accrue until ``now``.

    ``observed_until`` (instance id -> the last time fleetd saw it alive or, from EC2, its end):
    an instance with no recorded stop is billed no further than that. A report read after the
    controller stopped must not keep billing nodes it can no longer see (EC2 may have ended them
    long ago); the bill then says ``end_unseen``. Without it (the running daemon, which observes
    every instance each pass) running instances accrue until ``now``.

    The 60 s minimum is charged from launch (a launch commits it), so a running instance younger
    than a minute already owes its full minute.
    """
    observed_until = observed_until or {}
    ordered, paths = _billing(events)
    starts = _starts(ordered)
    stops: dict[str, float] = {}
    for e in ordered:
        if isinstance(e, InstanceStopped) and e.instance_id not in stops:
            stops[e.instance_id] = e.at
    out = []
    for iid, s in starts.items():
        stopped = stops.get(iid)
        unseen = False
        if stopped is not None:
            end = stopped
        else:
            end = max(now, s.at)
            seen = observed_until.get(iid)
            if seen is not None and seen < end:
                end, unseen = max(seen, s.at), True
        billed_s, usd = charge(s.at, end, s.price_per_hour, paths.get((s.pool, s.market), _NO_CHANGES))
        od = charge(s.at, end, s.on_demand_price_per_hour, paths.get((s.pool, Market.ON_DEMAND), _NO_CHANGES)).usd
        out.append(InstanceBill(iid, s.pool, s.market, s.at, stopped, billed_s, usd, od, unseen))
    return out


def _starts(ordered: Iterable[LedgerEvent]) -> dict[str, InstanceStarted]:
    """Each instance's first start, with its pool and launch prices corrected by the latest
    InstancePlaced (EC2's placement wins over what the launch reply said)."""
    starts: dict[str, InstanceStarted] = {}
    placed: dict[str, InstancePlaced] = {}
    for e in ordered:
        if isinstance(e, InstanceStarted) and e.instance_id not in starts:
            starts[e.instance_id] = e
        elif isinstance(e, InstancePlaced):
            placed[e.instance_id] = e
    for iid, p in placed.items():
        s = starts.get(iid)
        if s is not None and s.pool != p.pool:
            starts[iid] = replace(
                s, pool=p.pool, price_per_hour=p.price_per_hour, on_demand_price_per_hour=p.on_demand_price_per_hour
            )
    return starts


def spend_usd(events: Iterable[LedgerEvent], now: float, observed_until: Mapping[str, float] | None = None) -> float:
    return sum(b.usd for b in bills(events, now, observed_until))


@dataclass(frozen=True)
class SpendBasis:
    """``spend_usd(events, now)`` (no ``observed_until``) split into what no ``now`` changes (the
    ended instances) and what accrues (the running ones), so the daemon's per-pass spend is
    O(running nodes), not O(every event of the fleet's life): a simulated week made the pass 4x
    slower per day before (bench/long_run.py)."""

    closed_usd: float
    running: tuple[tuple[InstanceStarted, _PricePath], ...]

    def at(self, now: float) -> float:
        total = self.closed_usd
        for s, path in self.running:
            total += charge(s.at, now, s.price_per_hour, path).usd
        return total


def _billing(events: Iterable[LedgerEvent]) -> tuple[list[LedgerEvent], dict[tuple[PoolId, Market], _PricePath]]:
    """The billing events in order (goodput events can be far more numerous) and each pool's
    price path."""
    ordered = _ordered(
        e for e in events if isinstance(e, (InstanceStarted, InstancePlaced, InstanceStopped, PriceChanged))
    )
    prices: dict[tuple[PoolId, Market], list[tuple[float, float]]] = defaultdict(list)
    for e in ordered:
        if isinstance(e, PriceChanged):
            prices[(e.pool, e.market)].append((e.at, e.price_per_hour))
    return ordered, {key: _PricePath(changes) for key, changes in prices.items()}


def spend_basis(events: Iterable[LedgerEvent]) -> SpendBasis:
    events = list(events)
    ordered, paths = _billing(events)
    stops: dict[str, float] = {}
    for e in ordered:
        if isinstance(e, InstanceStopped) and e.instance_id not in stops:
            stops[e.instance_id] = e.at
    closed = sum(e.usd for e in events if isinstance(e, BillsRolledUp))
    running = []
    for iid, s in _starts(ordered).items():
        path = paths.get((s.pool, s.market), _NO_CHANGES)
        stopped = stops.get(iid)
        if stopped is None:
            running.append((s, path))
        else:
            closed += charge(s.at, stopped, s.price_per_hour, path).usd
    return SpendBasis(closed, tuple(running))


BILLING_EVENTS = (InstanceStarted, InstancePlaced, InstanceStopped, PriceChanged, BillsRolledUp)


def summarize(
    events: Iterable[LedgerEvent], now: float, observed_until: Mapping[str, float] | None = None
) -> LedgerSummary:
    events = list(events)
    all_bills = bills(events, now, observed_until)
    spend = sum(b.usd for b in all_bills)
    od = sum(b.on_demand_equivalent_usd for b in all_bills)
    by_market: dict[str, float] = defaultdict(float)
    by_pool: dict[str, float] = defaultdict(float)
    for b in all_bills:
        by_market[b.market.value] += b.usd
        by_pool[str(b.pool)] += b.usd
    rolled = [e for e in events if isinstance(e, BillsRolledUp)]
    for r in rolled:
        spend += r.usd
        od += r.on_demand_usd
        for k, v in r.usd_by_market.items():
            by_market[k] += v
        for k, v in r.usd_by_pool.items():
            by_pool[k] += v
    highest = 0
    lost = 0
    recovery = 0.0
    idle = 0.0
    for e in _ordered(events):
        if isinstance(e, StepReached):
            highest = max(highest, e.step)
        elif isinstance(e, StepsLost):
            lost += max(0, e.from_step - e.to_step)
        elif isinstance(e, StepsRegained):
            lost -= max(0, e.steps)
        elif isinstance(e, RecoveryTime):
            recovery += e.seconds
        elif isinstance(e, IdleGpuTime):
            idle += e.gpu_seconds
        elif isinstance(e, BillsRolledUp):
            idle += e.idle_gpu_s
    # Redone steps do not count twice: useful progress is the highest step reached.
    useful = highest
    return LedgerSummary(
        spend_usd=spend,
        on_demand_equivalent_usd=od,
        savings_pct=(100.0 * (1.0 - spend / od)) if od > 0 else 0.0,
        spend_by_market=dict(by_market),
        spend_by_pool=dict(by_pool),
        node_seconds=sum(b.billed_seconds for b in all_bills) + sum(r.billed_seconds for r in rolled),
        useful_steps=useful,
        steps_lost=max(0, lost),  # a regain never outweighs the losses before it
        recovery_s=recovery,
        idle_gpu_s=idle,
        usd_per_1k_steps=(1000.0 * spend / useful) if useful > 0 else None,
        instances=tuple(all_bills),
        scaling=tuple(e for e in _ordered(events) if isinstance(e, TargetChanged)),
        rolled_up_instances=sum(r.instances for r in rolled),
    )


def price_changes(
    known: Mapping[tuple[PoolId, Market], float], offers: Iterable[PoolOffer], now: float
) -> list[PriceChanged]:
    """PriceChanged events for every pool price that differs from ``known`` (the prices already
    recorded); the caller records them and updates ``known``. A pool with no spot price keeps its
    last spot price: running spot nodes are billed at it until they go."""
    out = []
    for o in offers:
        for market, price in ((Market.SPOT, o.spot_price), (Market.ON_DEMAND, o.on_demand_price)):
            if price is not None and known.get((o.pool, market)) != price:
                out.append(PriceChanged(now, o.pool, market, price))
    return out


def pool_history(
    events: Iterable[LedgerEvent], now: float, priors: dict[PoolId, float] | None = None
) -> dict[PoolId, PoolStats]:
    """Node-hours, notices and losses per pool: the learned half of the interruption rate."""
    priors = priors or {}
    hours: dict[PoolId, float] = defaultdict(float)
    notices: dict[PoolId, int] = defaultdict(int)
    losses: dict[PoolId, int] = defaultdict(int)
    last_notice: dict[PoolId, float] = {}
    ordered = _ordered(events)
    starts = _starts(ordered)
    stops: dict[str, float] = {}
    for e in ordered:
        if isinstance(e, InstanceStopped):
            stops.setdefault(e.instance_id, e.at)
        elif isinstance(e, Interruption):
            if e.kind == "notice":
                notices[e.pool] += 1
                last_notice[e.pool] = e.at
            else:
                losses[e.pool] += 1
    for iid, s in starts.items():
        end = stops.get(iid, now)
        hours[s.pool] += max(0.0, end - s.at) / 3600.0
    pools = set(hours) | set(notices) | set(losses) | set(priors)
    return {
        pool: PoolStats(
            pool=pool,
            node_hours=hours.get(pool, 0.0),
            notices=notices.get(pool, 0),
            losses=losses.get(pool, 0),
            last_notice_at=last_notice.get(pool),
            prior_interruptions_per_hour=priors.get(pool),
        )
        for pool in sorted(pools)
    }
