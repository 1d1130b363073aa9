"""Ledger: per-second accrual at the price in force, 60 s minimum, restart-safe persistence."""

from __future__ import annotations

import sqlite3

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetd.policy.ledger import (
    IdleGpuTime,
    InstancePlaced,
    InstanceStarted,
    InstanceStopped,
    Interruption,
    PriceChanged,
    RecoveryTime,
    StepReached,
    StepsLost,
    pool_history,
    price_changes,
    spend_usd,
    summarize,
)
from fleetd.policy.model import Market, PoolId, PoolOffer
from fleetd.reconcile.ledger_store import LedgerStore, LedgerStoreError

A = PoolId("g5.xlarge", "us-east-1a")
B = PoolId("g5.xlarge", "us-east-1b")
T0 = 1_000.0

# Hand-computed run (prices in USD per hour):
#   i-1 spot in A from T0 at 0.36; A's spot price becomes 0.72 at T0+1800 and 0.90 at T0+3000;
#       stopped at T0+3600: 1800 s x 0.36 + 1200 s x 0.72 + 600 s x 0.90 = 0.18 + 0.24 + 0.15 = 0.57
#   i-2 on-demand in B at 1.20 from T0+500, stopped after 30 s: 60 s minimum -> 0.02
#   i-3 spot in A from T0+2700 (price then 0.72), stopped at T0+3600:
#       300 s x 0.72 + 600 s x 0.90 = 0.06 + 0.15 = 0.21
#   total 0.80; on-demand equivalent 1.00 + 0.02 + 0.25 = 1.27
FIRST_HALF = [
    InstanceStarted(T0, "i-1", A, Market.SPOT, 0.36, 1.00, event_id="start-i-1"),
    InstanceStarted(T0 + 500, "i-2", B, Market.ON_DEMAND, 1.20, 1.20, event_id="start-i-2"),
    InstanceStopped(T0 + 530, "i-2", event_id="stop-i-2"),
    PriceChanged(T0 + 1800, A, Market.SPOT, 0.72, event_id="price-a-1"),
]
SECOND_HALF = [
    InstanceStarted(T0 + 2700, "i-3", A, Market.SPOT, 0.72, 1.00, event_id="start-i-3"),
    PriceChanged(T0 + 3000, A, Market.SPOT, 0.90, event_id="price-a-2"),
    InstanceStopped(T0 + 3600, "i-1", event_id="stop-i-1"),
    InstanceStopped(T0 + 3600, "i-3", event_id="stop-i-3"),
]
GOODPUT = [
    StepReached(T0 + 1000, 520),
    StepsLost(T0 + 1100, from_step=520, to_step=500),
    RecoveryTime(T0 + 1100, 4.5),
    IdleGpuTime(T0 + 2000, "i-1", 30.0),
    StepReached(T0 + 3500, 1600),
]


def test_hand_computed_total_with_price_changes_and_minimum_charge() -> None:
    s = summarize(FIRST_HALF + SECOND_HALF + GOODPUT, now=T0 + 10_000)
    assert round(s.spend_usd, 2) == 0.80
    assert s.spend_usd == pytest.approx(0.80, abs=1e-9)
    assert s.on_demand_equivalent_usd == pytest.approx(1.27, abs=1e-9)
    assert s.savings_pct == pytest.approx(100 * (1 - 0.80 / 1.27))
    assert s.spend_by_market == pytest.approx({"spot": 0.78, "on-demand": 0.02})
    assert s.spend_by_pool == pytest.approx({str(A): 0.78, str(B): 0.02})
    assert s.useful_steps == 1600 and s.steps_lost == 20
    assert s.recovery_s == 4.5 and s.idle_gpu_s == 30.0
    assert s.usd_per_1k_steps == pytest.approx(0.50)


def test_running_instance_accrues_to_now_and_owes_its_first_minute_at_once() -> None:
    started = [InstanceStarted(T0, "i-9", A, Market.SPOT, 0.36, 1.0)]
    assert spend_usd(started, now=T0 + 10) == pytest.approx(60 * 0.36 / 3600)
    assert spend_usd(started, now=T0 + 100) == pytest.approx(100 * 0.36 / 3600)


def test_price_change_before_launch_does_not_rewrite_the_launch_price() -> None:
    events = [
        PriceChanged(T0 - 10, A, Market.SPOT, 5.0),
        InstanceStarted(T0, "i-1", A, Market.SPOT, 0.36, 1.0),
        InstanceStopped(T0 + 3600, "i-1"),
    ]
    assert spend_usd(events, now=T0 + 9999) == pytest.approx(0.36)


async def test_restart_mid_run_recomputes_the_same_total(tmp_path) -> None:
    db = tmp_path / "fleetd.db"
    store = await LedgerStore.open(db)
    assert await store.append(*FIRST_HALF) == len(FIRST_HALF)
    # Mid-run: i-1 has run 1000 s at 0.36, i-2 owed its minimum: 0.10 + 0.02.
    assert round(await store.spent_usd(T0 + 1000), 2) == 0.12
    await store.close()  # fleetd stops (or crashes after the write)

    store = await LedgerStore.open(db)  # ... and comes back
    assert round(await store.spent_usd(T0 + 1000), 2) == 0.12
    # A retried write after the crash must not charge twice.
    assert await store.append(FIRST_HALF[0], *SECOND_HALF) == len(SECOND_HALF)
    await store.append(*GOODPUT)
    summary = await store.summary(T0 + 10_000)
    assert round(summary.spend_usd, 2) == 0.80
    assert summary.spend_usd == pytest.approx(0.80, abs=1e-9)
    assert summary.useful_steps == 1600 and summary.steps_lost == 20
    await store.close()


async def test_unreadable_rows_are_skipped_not_fatal(tmp_path) -> None:
    db = tmp_path / "fleetd.db"
    store = await LedgerStore.open(db)
    await store.append(*FIRST_HALF)
    await store.close()
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO ledger_events(at, kind, payload) VALUES (?, ?, ?)", (T0, "from-the-future", "{}"))
        conn.execute("INSERT INTO ledger_events(at, kind, payload) VALUES (?, ?, ?)", (T0, "instance-started", "[1]"))
    store = await LedgerStore.open(db)
    events = await store.events()
    await store.close()
    assert events == FIRST_HALF


def test_pool_history_counts_node_hours_notices_and_losses() -> None:
    events = (
        FIRST_HALF
        + SECOND_HALF
        + [
            Interruption(T0 + 3500, "i-1", A, "notice"),
            Interruption(T0 + 3600, "i-3", A, "loss"),
        ]
    )
    stats = pool_history(events, now=T0 + 9999, priors={A: 0.01})
    assert stats[A].node_hours == pytest.approx(1.0 + 0.25)
    assert (stats[A].notices, stats[A].losses, stats[A].last_notice_at) == (1, 1, T0 + 3500)
    assert stats[A].prior_interruptions_per_hour == 0.01
    assert stats[B].node_hours == pytest.approx(30 / 3600)


def test_price_changes_are_emitted_only_for_prices_that_moved() -> None:
    known = {(A, Market.SPOT): 0.36, (A, Market.ON_DEMAND): 1.0}
    offers = [PoolOffer(A, 1, 0.72, 1.0), PoolOffer(B, 1, None, 1.2)]
    assert price_changes(known, offers, T0) == [
        PriceChanged(T0, A, Market.SPOT, 0.72),
        PriceChanged(T0, B, Market.ON_DEMAND, 1.2),
    ]


async def test_unopenable_ledger_is_a_clear_error(tmp_path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(LedgerStoreError, match="cannot open ledger"):
        await LedgerStore.open(blocker / "fleetd.db")


def _naive_usd(start: float, end: float, initial: float, changes: list[tuple[float, float]]) -> float:
    """Reference: walk every change in time order (changes at or before the launch do not apply)."""
    usd, t, price = 0.0, start, initial
    for at, new_price in sorted(changes, key=lambda c: c[0]):
        if at <= start:
            continue
        if at >= end:
            break
        usd += price * (at - t) / 3600.0
        t, price = at, new_price
    return usd + price * (end - t) / 3600.0


@settings(max_examples=300, deadline=None, database=None)
@given(
    changes=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 500)), max_size=12),
    windows=st.lists(
        st.tuples(st.integers(0, 10_000), st.integers(0, 5_000), st.integers(1, 500)), min_size=1, max_size=4
    ),
)
def test_fast_accrual_matches_a_step_by_step_walk(changes, windows) -> None:
    events: list = [PriceChanged(float(t), A, Market.SPOT, p / 100) for t, p in changes]
    expected = 0.0
    for k, (start, length, price) in enumerate(windows):
        end = start + max(length, 60)  # the 60 s minimum
        events.append(InstanceStarted(float(start), f"i-{k}", A, Market.SPOT, price / 100, 9.0))
        events.append(InstanceStopped(float(start + length), f"i-{k}"))
        expected += _naive_usd(start, end, price / 100, [(float(t), p / 100) for t, p in changes])
    assert spend_usd(events, now=1e9) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_ec2_placement_corrects_the_pool_and_price_of_the_whole_bill() -> None:
    """A launch reply that named zone B for an instance EC2 placed in A: the bill, and every pool
    label the report prints, follow EC2."""
    events = [
        InstanceStarted(T0, "i-1", B, Market.SPOT, 0.50, 1.00),
        InstancePlaced(T0, "i-1", A, 0.36, 1.00),
        InstanceStopped(T0 + 3600, "i-1"),
    ]
    s = summarize(events, T0 + 7200)
    assert s.spend_by_pool == pytest.approx({str(A): 0.36})
    assert pool_history(events, T0 + 7200)[A].node_hours == pytest.approx(1.0)


def test_a_node_whose_end_was_not_seen_is_billed_until_last_seen_however_late_the_report() -> None:
    events = [InstanceStarted(T0, "i-1", A, Market.SPOT, 0.36, 1.00)]
    seen = {"i-1": T0 + 1800}
    early, late = summarize(events, T0 + 1800, seen), summarize(events, T0 + 86_400, seen)
    assert early.spend_usd == pytest.approx(0.18) == late.spend_usd
    assert [b.instance_id for b in late.end_unseen] == ["i-1"]
    assert late.as_json()["instances_end_unseen"][0]["billed_until"] == T0 + 1800
    # Without sightings (the running daemon, which sees every node each pass) it accrues to now.
    assert summarize(events, T0 + 3600).spend_usd == pytest.approx(0.36)


@given(
    st.integers(min_value=0, max_value=len(FIRST_HALF + SECOND_HALF)),
    st.floats(min_value=T0 - 100, max_value=T0 + 10_000),
)
def test_spend_basis_equals_the_full_recomputation_at_any_time(prefix, now) -> None:
    """The daemon's cached spend (ended part kept, running part accrued) is the same number."""
    from fleetd.policy.ledger import spend_basis

    events = (FIRST_HALF + SECOND_HALF)[:prefix] + GOODPUT
    assert spend_basis(events).at(now) == pytest.approx(spend_usd(events, now), abs=1e-9)


async def test_the_stores_cached_spend_follows_appended_billing_events(tmp_path) -> None:
    store = await LedgerStore.open(tmp_path / "fleetd.db")
    try:
        await store.append(*FIRST_HALF)
        assert await store.spent_usd(T0 + 3600) == pytest.approx(spend_usd(FIRST_HALF, T0 + 3600))
        await store.append(*GOODPUT)  # no billing event: the cached part stays
        await store.append(*SECOND_HALF)
        assert await store.spent_usd(T0 + 3600) == pytest.approx(0.80)
    finally:
        await store.close()
