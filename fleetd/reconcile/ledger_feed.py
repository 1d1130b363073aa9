"""Budget-ledger events from what the reconcile loop records (starts, stops, losses, notices, prices)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from fleetd.adapters.pricing import PoolPrice
from fleetd.policy import ledger
from fleetd.policy.goodput import GoodputTracker
from fleetd.policy.model import Market, Node, PoolId
from fleetd.reconcile import state as st
from fleetd.reconcile.ports import LedgerSink
from fleetd.reconcile.prices import price_of
from fleetd.reconcile.state_port import StateBackend
from fleetd.reconcile.state_rows import InstanceRow
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

# The ledger's rows older than this are rolled up once an hour (fleetd.policy.ledger_compact):
# ended instances into one sum, steps to one per 10 min. Before, a day at a 10 s interval wrote
# ~3 MiB of step rows alone, forever, and the daemon held every row in memory.
COMPACT_AFTER_S = 6 * 3600.0
COMPACT_EVERY_S = 3600.0


class LedgerFeed:
    """Turns what the loop records into budget-ledger events (each with a stable event_id, so a
    re-sent event is stored once). The first pass after a start re-sends everything still open:
    events lost in a crash between the state DB and the ledger are recovered that way."""

    def __init__(self, sink: LedgerSink, stall_after_s: float = 10.0):
        self.sink = sink
        self._resynced = False
        self._goodput = GoodputTracker(stall_after_s=stall_after_s)
        self._goodput_seeded = False
        self._last_price: dict[tuple[PoolId, Market], float] = {}
        self._pool_of: dict[str, PoolId] = {}  # the pool last recorded for each open instance
        self._compacted_at: float | None = None

    async def feed(
        self,
        state: StateBackend,
        now: float,
        prices: Mapping[PoolId, PoolPrice],
        sync: st.SyncReport,
        notices: Sequence[str],
    ) -> None:
        resync_pass = not self._resynced
        rows, started, stopped, noticed = await self._changed_rows(state, now, sync, notices)
        events: list[ledger.LedgerEvent] = [self._start(r, prices.get(r.pool)) for r in started]
        if not resync_pass:
            self._pool_of.update((r.instance_id, r.pool) for r in started)
        # EC2's placement is the pool label everywhere (status, metrics, report): a launch reply's
        # guess that EC2 contradicts is corrected in the ledger too (fleetd.policy.ledger.InstancePlaced).
        # After a restart every open instance is re-placed (stored once per pool by its event_id):
        # the start already stored may carry the guess.
        for r in rows:
            if r.open and self._pool_of.get(r.instance_id) != r.pool:
                events.append(self._placed(r, prices.get(r.pool)))
                self._pool_of[r.instance_id] = r.pool
        for r in stopped:
            self._pool_of.pop(r.instance_id, None)
            events += _stop_events(r, now)
        events += [_interruption(r, "notice", r.notice_at or now) for r in noticed]
        events += self._price_changes(rows, prices, now)
        if events:
            await self.sink.append(*events)

    async def _changed_rows(
        self, state: StateBackend, now: float, sync: st.SyncReport, notices: Sequence[str]
    ) -> tuple[list[InstanceRow], list[InstanceRow], list[InstanceRow], list[InstanceRow]]:
        """(open rows, started, stopped, noticed) for this pass: every row on the first pass after a
        start (a resync), else only the rows this pass changed."""
        if not self._resynced:
            # Instances that ended before the compaction horizon are not re-sent: compaction
            # may have rolled their rows up (their event_ids are gone, so a re-send would
            # count them twice). A crash loses at most the last pass's events, never older.
            rows = [
                r
                for r in await state.instances(open_only=False)
                if r.ended_at is None or r.ended_at >= now - COMPACT_AFTER_S
            ]
            self._resynced = True
            return (
                rows,
                list(rows),
                [r for r in rows if r.ended_at is not None],
                [r for r in rows if r.notice_at is not None],
            )
        changed = {*sync.adopted, *(i for i, _ in sync.ended), *notices}
        by_id = {r.instance_id: r for r in await state.instances_by_id(sorted(changed))} if changed else {}
        started = [by_id[i] for i in sync.adopted if i in by_id]
        stopped = [by_id[i] for i, _ in sync.ended if i in by_id]
        noticed = [by_id[i] for i in notices if i in by_id]
        return await state.instances(), started, stopped, noticed

    def _price_changes(
        self, rows: Sequence[InstanceRow], prices: Mapping[PoolId, PoolPrice], now: float
    ) -> list[ledger.LedgerEvent]:
        """A PriceChanged for each open (pool, market) whose price moved since it was last recorded."""
        out: list[ledger.LedgerEvent] = []
        for key in sorted({(r.pool, r.market) for r in rows if r.open}):
            price = price_of(key[1], prices.get(key[0]))
            if price and self._last_price.get(key) != price:
                self._last_price[key] = price
                out.append(
                    ledger.PriceChanged(
                        at=now,
                        pool=key[0],
                        market=key[1],
                        price_per_hour=price,
                        event_id=f"price:{key[0]}:{key[1]}:{now:.3f}",
                    )
                )
        return out

    async def progress(self, nodes: Sequence[Node], now: float, gpus_of: Mapping[str, int]) -> None:
        """Goodput events from the trainers' progress as the nodes report it (policy/goodput.py)."""
        if not self._goodput_seeded:
            events = getattr(self.sink, "events", None)
            if events is not None:
                self._goodput.resume(await events())  # after a restart: steps already counted
            self._goodput_seeded = True
        out = self._goodput.observe(nodes, now, gpus_of)
        if out:
            await self.sink.append(*out)
        await self._compact(now)

    async def _compact(self, now: float) -> None:
        compact = getattr(self.sink, "compact", None)  # the SQLite ledger; DynamoDB's keeps every row
        if compact is None or (self._compacted_at is not None and now - self._compacted_at < COMPACT_EVERY_S):
            return
        self._compacted_at = now
        dropped, added = await compact(now - COMPACT_AFTER_S)
        if dropped or added:
            log.info("ledger_compacted", dropped=dropped, added=added, older_than_s=COMPACT_AFTER_S)

    async def target_changed(self, now: float, previous: int, target: int, reason: str) -> None:
        await self.sink.append(
            ledger.TargetChanged(
                at=now, previous=previous, target=target, reason=reason, event_id=f"target:{now:.3f}:{target}"
            )
        )

    async def started(
        self, rows: Sequence[st.InstanceRow], ids: Sequence[str], prices: Mapping[PoolId, PoolPrice]
    ) -> None:
        wanted = set(ids)
        events = [self._start(r, prices.get(r.pool)) for r in rows if r.instance_id in wanted]
        for r in rows:
            if r.instance_id in wanted:
                self._pool_of[r.instance_id] = r.pool
        if events:
            await self.sink.append(*events)

    @staticmethod
    def _placed(r: st.InstanceRow, price: PoolPrice | None) -> ledger.InstancePlaced:
        on_demand = price.on_demand if price and price.on_demand else r.price_per_hour
        return ledger.InstancePlaced(
            at=r.launched_at,
            instance_id=r.instance_id,
            pool=r.pool,
            price_per_hour=price_of(r.market, price) or r.price_per_hour,
            on_demand_price_per_hour=on_demand,
            event_id=f"placed:{r.instance_id}:{r.pool}",
        )

    @staticmethod
    def _start(r: st.InstanceRow, price: PoolPrice | None) -> ledger.InstanceStarted:
        on_demand = price.on_demand if price and price.on_demand else r.price_per_hour
        return ledger.InstanceStarted(
            at=r.launched_at,
            instance_id=r.instance_id,
            pool=r.pool,
            market=r.market,
            price_per_hour=r.price_per_hour,
            on_demand_price_per_hour=on_demand,
            event_id=f"start:{r.instance_id}",
        )


def _stop_events(r: InstanceRow, now: float) -> list[ledger.LedgerEvent]:
    """An instance's end, and its loss when it ended lost."""
    out: list[ledger.LedgerEvent] = [
        ledger.InstanceStopped(at=r.ended_at or now, instance_id=r.instance_id, event_id=f"stop:{r.instance_id}")
    ]
    if (r.end_reason or "").startswith("lost"):
        out.append(_interruption(r, "loss", r.ended_at or now))
    return out


def _interruption(r: InstanceRow, kind: Literal["notice", "loss"], at: float) -> ledger.LedgerEvent:
    """A notice or a loss of ``r``'s instance, stored once (its event_id names both)."""
    return ledger.Interruption(
        at=at, instance_id=r.instance_id, pool=r.pool, kind=kind, event_id=f"{kind}:{r.instance_id}"
    )
