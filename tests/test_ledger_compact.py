"""Ledger compaction (fleetd/policy/ledger_compact.py, LedgerStore.compact): the per-pass rows
older than the horizon are rolled up, and `fleetd report`'s totals are the same before and after,
in memory, on disk and after a reopen. Real SQLite store, the report's own summary function."""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetd.policy import ledger
from fleetd.policy.ledger_compact import compact
from fleetd.policy.model import Market, PoolId
from fleetd.reconcile.ledger_store import DB_NAME, LedgerStore

POOL = PoolId("g5.xlarge", "us-east-1a")
T0 = 1_800_000_000.0


def close(a: object, b: object) -> bool:
    """Equal to the report's precision: floats within 1e-9 relative, or one unit of the sixth
    decimal the report rounds to (a sum of rolled-up bills, each already rounded to 6 decimals,
    can land one micro-dollar away from the same sum rounded once: hypothesis found 3.008128 vs
    3.008127)."""
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= max(1e-9 * max(1.0, abs(a), abs(b)), 1.001e-6)  # type: ignore[operator]
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def same_totals(a: ledger.LedgerSummary, b: ledger.LedgerSummary) -> None:
    """`fleetd report`'s numbers (its JSON is summary.as_json()), computed exactly (unrounded)."""
    ja, jb = a.as_json(), b.as_json()
    assert ja.keys() == jb.keys()
    for key in ja:
        assert close(ja[key], jb[key]), (key, ja[key], jb[key])
    for f in ("spend_usd", "on_demand_equivalent_usd", "node_seconds", "idle_gpu_s", "savings_pct"):
        assert close(getattr(a, f), getattr(b, f)), f
    assert close(a.spend_by_pool, b.spend_by_pool) and close(a.spend_by_market, b.spend_by_market)


def a_week(passes: int, interval: float, seed: int = 1) -> list:
    """A fleet's ledger as the daemon writes it: starts, stops, notices, prices, a step every
    pass with progress, idle GPU time for idle nodes, a resume below the highest step."""
    rng = random.Random(seed)
    events: list = [ledger.PriceChanged(T0, POOL, Market.SPOT, 0.4, event_id="price:0")]
    live: list[str] = []
    step = 0
    for k in range(passes):
        now = T0 + k * interval
        if len(live) < 4 or rng.random() < 0.02:
            iid = f"i-{k:08d}"
            live.append(iid)
            events.append(ledger.InstanceStarted(now, iid, POOL, Market.SPOT, 0.4, 1.0, event_id=f"start:{iid}"))
        if len(live) > 4 and rng.random() < 0.05:
            iid = live.pop(0)
            events += [
                ledger.Interruption(now, iid, POOL, "notice", event_id=f"notice:{iid}"),
                ledger.InstanceStopped(now + 60, iid, event_id=f"stop:{iid}"),
            ]
        if rng.random() < 0.01:
            events.append(
                ledger.PriceChanged(now, POOL, Market.SPOT, round(rng.uniform(0.3, 0.5), 4), event_id=f"price:{k}")
            )
        if rng.random() < 0.01 and step > 50:
            events.append(ledger.StepsLost(now, step, step - 30, event_id=f"lost:{k}"))
            step -= 30
        else:
            step += rng.randint(0, 20)
            events.append(ledger.StepReached(now, step, event_id=f"step:{k}"))
        for iid in live:
            if rng.random() < 0.3:
                events.append(ledger.IdleGpuTime(now, iid, interval * rng.random(), event_id=f"idle:{iid}:{k}"))
    return events


def test_compaction_keeps_the_report_and_drops_the_per_pass_rows() -> None:
    events = a_week(passes=6 * 1440, interval=60.0)  # six simulated days at one pass a minute
    now = T0 + 6 * 86400
    plan = compact(events, before=now - 6 * 3600)
    dropped = {id(e) for e in plan.drop}
    after = [e for e in events if id(e) not in dropped] + list(plan.add)
    same_totals(ledger.summarize(events, now), ledger.summarize(after, now))
    assert len(after) < len(events) / 3
    rolled = [e for e in after if isinstance(e, ledger.BillsRolledUp)]
    assert len(rolled) == 1 and rolled[0].instances > 10
    assert ledger.spend_basis(after).at(now) == ledger.spend_basis(events).at(now) or close(
        ledger.spend_basis(after).at(now), ledger.spend_basis(events).at(now)
    )
    # Compacting again changes nothing; the newest six hours are untouched.
    assert compact(after, before=now - 6 * 3600).empty
    recent = [e for e in events if e.at >= now - 6 * 3600]
    assert all(any(e is x for x in after) for e in recent)


@settings(max_examples=15, deadline=None)
@given(st.integers(50, 600), st.sampled_from([10.0, 60.0, 300.0]), st.integers(0, 10**6), st.floats(0.0, 1.0))
def test_any_ledger_any_horizon_same_totals(passes: int, interval: float, seed: int, cut: float) -> None:
    events = a_week(passes, interval, seed)
    now = T0 + passes * interval
    plan = compact(events, before=T0 + cut * passes * interval)
    dropped = {id(e) for e in plan.drop}
    after = [e for e in events if id(e) not in dropped] + list(plan.add)
    same_totals(ledger.summarize(events, now), ledger.summarize(after, now))
    assert len(after) <= len(events)


async def test_the_store_compacts_on_disk_and_a_reopen_reports_the_same(tmp_path: Path) -> None:
    events = a_week(passes=3 * 1440, interval=60.0, seed=7)
    now = T0 + 3 * 86400
    store = await LedgerStore.open(tmp_path / DB_NAME)
    try:
        await store.append(*events)
        before = await store.summary(now)
        spent = await store.spent_usd(now)
        rows_before = store._conn.execute("SELECT count(*) FROM ledger_events").fetchone()[0]
        dropped, added = await store.compact(now - 6 * 3600)
        assert dropped > added > 0
        rows_after = store._conn.execute("SELECT count(*) FROM ledger_events").fetchone()[0]
        assert rows_after == rows_before - dropped + added
        same_totals(before, await store.summary(now))
        assert await store.spent_usd(now) == spent
        assert await store.compact(now - 6 * 3600) == (0, 0)
    finally:
        await store.close()
    reopened = await LedgerStore.open(tmp_path / DB_NAME)
    try:
        same_totals(before, await reopened.summary(now))
        assert len(await reopened.events()) == rows_after
    finally:
        await reopened.close()
