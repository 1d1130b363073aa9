"""The reconcile loop's state: launch intents, instance records, pool statistics. Every test but
the SQLite snapshot's runs against both backends (SQLite, DynamoDB on moto server: tests/ha_support.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetd.policy.model import Market, PoolId
from fleetd.reconcile import state as st
from fleetd.reconcile.state import SeenInstance, StateStore
from tests.ha_support import Opener

A = PoolId("g4dn.xlarge", "us-east-1a")
T0 = 1_800_000_000.0


def seen(
    iid: str, state: str = "running", launched_at: float = T0, token: str | None = "tok", reason: str = ""
) -> SeenInstance:
    return SeenInstance(iid, A, Market.SPOT, state, launched_at, token, 0.25, reason)


async def intent(store, token: str, now: float = T0) -> None:
    await store.record_intent(
        token=token,
        seq=0,
        now=now,
        count=2,
        market=Market.SPOT,
        pools=(A,),
        purpose="capacity",
        max_price_per_hour=0.5,
        reason="test",
    )


async def test_intents_survive_reopen_and_a_new_plan_supersedes_an_open_one(open_state: Opener) -> None:
    store = await open_state()
    await intent(store, "tok-1")
    await intent(store, "tok-1")  # the same planned launch again: one row
    await store.close()
    store = await open_state()
    (row,) = await store.launches(st.OPEN)
    assert (row.token, row.count, row.pools, row.max_price_per_hour) == ("tok-1", 2, (A,), 0.5)
    assert await store.settled_launch_count() == 0
    await intent(store, "tok-2", now=T0 + 10)
    assert [(r.token, r.status) for r in await store.launches()] == [("tok-1", st.ABANDONED), ("tok-2", st.OPEN)]
    await store.settle_launch("tok-2", st.LAUNCHED, ["i-2", "i-1"], T0 + 11)
    assert (await store.launches(st.LAUNCHED))[0].instance_ids == ("i-1", "i-2")
    assert await store.settled_launch_count() == 2
    await store.close()


async def test_sync_adopts_accrues_and_closes(open_state: Opener) -> None:
    store = await open_state()
    report = await store.sync_instances([seen("i-1", launched_at=T0 - 3600), seen("i-2")], T0)
    assert report.adopted == ("i-1", "i-2")  # unknown running instances: adopted, hours since launch
    await store.sync_instances([seen("i-1"), seen("i-2")], T0 + 1800)
    await store.mark_terminate_requested(["i-2"], T0 + 1800)
    report = await store.sync_instances(
        [seen("i-1", "terminated", reason="Server.SpotInstanceTermination"), seen("i-2", "shutting-down")], T0 + 3600
    )
    assert dict(report.ended) == {"i-1": "lost (Server.SpotInstanceTermination)", "i-2": "terminated by fleetd"}
    (stats,) = await store.pool_stats()
    assert stats.node_hours == pytest.approx(2.0 + 1.0)  # i-1: 2 h (adopted 1 h old), i-2: 1 h
    assert (stats.losses, stats.notices) == (1, 0)
    assert await store.instances() == []
    # Gone from DescribeInstances: nothing more to close, nothing re-adopted.
    report = await store.sync_instances([seen("i-1", "terminated")], T0 + 7200)
    assert report == st.SyncReport()
    await store.close()


async def test_notice_counted_once_and_an_interruption_after_it_is_not_a_loss(open_state: Opener) -> None:
    store = await open_state()
    await store.sync_instances([seen("i-1")], T0)
    assert await store.record_notice("i-1", T0 + 5) is True
    assert await store.record_notice("i-1", T0 + 6) is False
    assert await store.record_notice("i-unknown", T0 + 6) is False
    report = await store.sync_instances([seen("i-1", "terminated")], T0 + 120)
    assert dict(report.ended) == {"i-1": "interrupted after notice"}
    (stats,) = await store.pool_stats()
    assert (stats.notices, stats.losses, stats.last_notice_at) == (1, 0, T0 + 5)
    await store.close()


async def test_capacity_ttl_only_extends(open_state: Opener) -> None:
    store = await open_state()
    await store.mark_pool_unavailable(A, T0 + 600, "InsufficientInstanceCapacity")
    await store.mark_pool_unavailable(A, T0 + 300, "SpotMaxPriceTooLow")
    (stats,) = await store.pool_stats()
    assert (stats.capacity_error_until, stats.capacity_errors, stats.last_error_code) == (
        T0 + 600,
        2,
        "SpotMaxPriceTooLow",
    )
    await store.close()


async def test_meta(open_state: Opener) -> None:
    # Spend is the ledger's alone (fleetd.policy.ledger.charge): the state keeps no estimate of it.
    store = await open_state()
    await store.set_meta("target_nodes", 3)
    await store.set_meta("target_nodes", 4)
    assert await store.get_meta("target_nodes") == 4 and await store.get_meta("missing", "d") == "d"
    await store.close()


async def test_snapshot_reads_the_live_state_but_never_writes_it(tmp_path: Path) -> None:
    live = await StateStore.open(tmp_path)
    await intent(live, "tok-1")
    await live.close()
    snap = await StateStore.open_snapshot(tmp_path)
    assert [r.token for r in await snap.launches()] == ["tok-1"]
    await intent(snap, "tok-2")
    copy_dir = snap.path.parent
    assert copy_dir != tmp_path and copy_dir.exists()
    await snap.close()
    assert not copy_dir.exists()  # the private copy goes with the dry run (it used to pile up in /tmp)
    live = await StateStore.open(tmp_path)
    assert [r.token for r in await live.launches()] == ["tok-1"]
    await live.close()


async def test_unresolved_launches_include_recently_abandoned_ones(open_state: Opener) -> None:
    store = await open_state()
    await intent(store, "tok-old", now=T0 - 7200)
    await intent(store, "tok-1", now=T0 - 10)  # abandons tok-old at T0 - 10
    await intent(store, "tok-2", now=T0)  # abandons tok-1 now
    unresolved = {r.token: r.status for r in await store.unresolved_launches(since=T0 - 3600)}
    assert unresolved == {"tok-old": st.ABANDONED, "tok-1": st.ABANDONED, "tok-2": st.OPEN}
    assert {r.token for r in await store.unresolved_launches(since=T0 + 1)} == {"tok-2"}
    await store.close()


async def test_an_instance_ends_when_ec2_says_not_when_fleetd_notices(open_state: Opener) -> None:
    """Billing and node-hours stop at EC2's transition time; an instance gone from EC2 altogether
    stops when fleetd last saw it alive (a controller down for an hour must not bill that hour)."""
    store = await open_state()
    await store.sync_instances([seen("i-1"), seen("i-2")], T0)
    await store.sync_instances([seen("i-1"), seen("i-2")], T0 + 600)
    ended = SeenInstance("i-1", A, Market.SPOT, "terminated", T0, "tok", 0.25, "", ended_at=T0 + 900)
    await store.sync_instances([ended], T0 + 3600)  # i-2 not listed at all any more
    rows = {r.instance_id: r for r in await store.instances(open_only=False)}
    assert rows["i-1"].ended_at == T0 + 900
    assert rows["i-2"].ended_at == T0 + 600
    (stats,) = await store.pool_stats()
    assert stats.node_hours == pytest.approx((900 + 600) / 3600)
    assert store.observed_until_sync() == {"i-1": T0 + 900, "i-2": T0 + 600}
    await store.close()


async def test_close_waits_for_a_call_whose_task_was_cancelled(tmp_path: Path) -> None:
    """A bounded shutdown cancels tasks whose SQLite call still runs in a worker thread. Closing
    the connection under that call is a use-after-free in sqlite3 that crashed the whole process
    (CI's test run); close must wait for the call, and a call after close fails cleanly."""
    import asyncio
    import threading

    store = await StateStore.open(tmp_path)
    inside, release = threading.Event(), threading.Event()
    rows: list[int] = []

    def slow(db) -> None:
        inside.set()
        release.wait(10)
        rows.append(db.execute("SELECT COUNT(*) FROM launches").fetchone()[0])

    call = asyncio.create_task(store._run(slow))
    assert await asyncio.to_thread(inside.wait, 10)
    call.cancel()  # the task ends; its thread goes on
    closing = asyncio.create_task(store.close())
    await asyncio.sleep(0.3)
    assert not closing.done()  # waits for the running call instead of closing under it
    release.set()
    await asyncio.wait_for(closing, 10)
    assert rows == [0]  # the call finished on an open connection
    with pytest.raises(AssertionError, match="closed"):
        await store.settled_launch_count()


async def test_whole_table_reads_are_served_from_memory_until_a_row_changes(tmp_path: Path) -> None:
    """A pass, the ledger feed and the status snapshot each read every open row; the copy is
    reused until any write of this store changes a row (then the next read sees the change)."""
    store = await StateStore.open(tmp_path)
    selects: list[str] = []
    try:
        assert store._db is not None
        store._db.set_trace_callback(lambda sql: selects.append(sql) if sql.startswith("SELECT") else None)
        await store.sync_instances([seen("i-1"), seen("i-2")], T0)
        first = await store.instances()
        n = len(selects)
        again = await store.instances()
        assert again == first and again is not first and len(selects) == n  # no query: the copy
        again.clear()  # the caller's own list: the copy is untouched
        assert len(await store.instances()) == 2
        assert await store.record_notice("i-1", T0 + 5)  # a write: the next read queries again
        rows = {r.instance_id: r for r in await store.instances()}
        assert rows["i-1"].notice_at == T0 + 5 and len(selects) > n
        await store.mark_terminate_requested(["i-2"], T0 + 6)
        assert {r.instance_id: r for r in await store.instances()}["i-2"].terminate_requested_at == T0 + 6
        await store.sync_instances([seen("i-1", "terminated"), seen("i-2")], T0 + 10)
        assert [r.instance_id for r in await store.instances()] == ["i-2"]
        assert {r.instance_id for r in await store.instances(open_only=False)} == {"i-1", "i-2"}
        assert [r.instance_id for r in await store.instances_by_id(["i-1"])] == ["i-1"]  # by id: never cached
    finally:
        await store.close()


async def test_meta_is_read_once_and_written_through(tmp_path: Path) -> None:
    store = await StateStore.open(tmp_path)
    selects: list[str] = []
    try:
        assert store._db is not None
        store._db.set_trace_callback(lambda sql: selects.append(sql) if "FROM meta" in sql else None)
        assert await store.get_meta("target_nodes") is None
        await store.set_meta("target_nodes", 4)
        await store.set_meta("budget", {"level": "normal"})
        got = await store.get_meta("budget")
        got["level"] = "changed"  # the caller's own copy
        assert await store.get_meta("budget") == {"level": "normal"}
        assert await store.get_meta("target_nodes") == 4 and await store.get_meta("nope", 7) == 7
        assert len(selects) == 1  # one read of the table; every later answer from memory
    finally:
        await store.close()
    store = await StateStore.open(tmp_path)  # what was written is on disk
    try:
        assert await store.get_meta("target_nodes") == 4
    finally:
        await store.close()


async def test_a_pass_that_only_moves_its_bookkeeping_keeps_the_rows_it_read(tmp_path: Path) -> None:
    """Every pass writes every live instance's last-seen and accounted-until time; no InstanceRow
    shows them, so the rows read before stay valid (no re-read of 2,000 rows a pass). What an
    InstanceRow does show (EC2's state) is read again, and the hours still add up."""
    store = await StateStore.open(tmp_path)
    reads: list[str] = []
    try:
        assert store._db is not None
        store._db.set_trace_callback(
            lambda sql: reads.append(sql) if sql.startswith("SELECT instance_id, pool") else None
        )
        await store.sync_instances([seen("i-1", "pending"), seen("i-2")], T0)
        rows = await store.instances()
        n = len(reads)
        for k in range(1, 4):
            await store.sync_instances([seen("i-1", "pending"), seen("i-2")], T0 + 600 * k)
            assert await store.instances() == rows
        assert len(reads) == n  # the bookkeeping moved, the rows did not: no read
        await store.sync_instances([seen("i-1", "running"), seen("i-2")], T0 + 2400)
        assert {r.instance_id: r.ec2_state for r in await store.instances()} == {"i-1": "running", "i-2": "running"}
        assert len(reads) == n + 1
        (stats,) = await store.pool_stats()
        assert stats.node_hours == pytest.approx(2 * 2400 / 3600)  # accrued every pass all the same
    finally:
        await store.close()
