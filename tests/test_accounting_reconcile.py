"""Spend on the reconcile loop's real path (moto server): a node's bill ends where EC2 says it
ended, and a report read while the controller is down bills nodes it did not see end only up to
when it last saw them, however late the report."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from fleetd.policy import ledger
from fleetd.policy.planner import plan
from fleetd.reconcile.build import build_reconciler
from fleetd.reconcile.ledger_store import DB_NAME, LedgerStore
from fleetd.reconcile.state import StateStore
from tests.reconcile_support import Cloud, pools_of


async def _passes(cfg, cloud: Cloud, store: LedgerStore, n: int) -> None:
    async with cloud.client() as client:
        built = await build_reconciler(cfg, client, planner=plan, ledger=store)
        try:
            for _ in range(n):
                report = await built.reconciler.run_pass()
                assert report.error is None, report.error
                await asyncio.sleep(0.3)
        finally:
            await built.close()


async def _observed_until(state_dir: Path) -> dict[str, float]:
    state = await StateStore.open(state_dir)
    try:
        return state.observed_until_sync()
    finally:
        await state.close()


async def test_report_after_the_controller_stopped_and_ec2_end_times(cloud: Cloud, tmp_path: Path) -> None:
    cfg = cloud.config(tmp_path)
    store = await LedgerStore.open(tmp_path / DB_NAME)
    try:
        await _passes(cfg, cloud, store, 3)  # buy 3, then see them running
        live = await cloud.instances()
        assert len(live) == 3
        stopped_at = time.time()
        events = await store.events()
        summary = ledger.summarize(events, stopped_at, await _observed_until(tmp_path))
        # One pool label per node: the ledger's pools are EC2's placements.
        assert sorted(summary.spend_by_pool) == sorted({str(p) for p in pools_of(live)})

        # The controller is down; AWS ends the nodes; a report reads the ledger hours later.
        for inst in live:
            await cloud.terminate_directly(inst["InstanceId"])
        seen = await _observed_until(tmp_path)
        later = ledger.summarize(events, stopped_at + 6 * 3600, seen)
        assert later.spend_usd == pytest.approx(summary.spend_usd)
        assert sorted(b.instance_id for b in later.end_unseen) == sorted(i["InstanceId"] for i in live)
        for b in later.end_unseen:  # to the last sighting (or the 60 s minimum), not 6 h later
            assert b.started_at + b.billed_seconds <= max(stopped_at, b.started_at + ledger.MINIMUM_CHARGE_S)

        # The controller comes back: EC2's termination time ends each bill, not the restart.
        await asyncio.sleep(2.0)
        restarted = time.time()
        await _passes(cfg, cloud, store, 1)
        events = await store.events()
        stops = {e.instance_id: e.at for e in events if isinstance(e, ledger.InstanceStopped)}
        assert set(stops) >= {i["InstanceId"] for i in live}
        for inst in live:
            # EC2's time (second resolution), never before fleetd last saw it, before the restart.
            assert seen[inst["InstanceId"]] <= stops[inst["InstanceId"]] < restarted
        final = ledger.summarize(events, restarted + 6 * 3600, await _observed_until(tmp_path))
        ended = [b for b in final.instances if b.instance_id in stops]
        assert not [b for b in ended if b.end_unseen]
        for b in ended:
            assert b.stopped_at == stops[b.instance_id]
    finally:
        await store.close()


def test_transition_time_from_aws_and_moto_reasons() -> None:
    from datetime import UTC, datetime

    from fleetd.adapters.ec2_times import transition_time

    at = datetime(2026, 11, 24, 5, 0, 1, tzinfo=UTC).timestamp()
    assert transition_time("User initiated (2026-11-24 05:00:01 GMT)") == at  # AWS
    assert transition_time("User initiated (2026-11-24 05:00:01 UTC)") == at  # moto
    assert transition_time("Server.SpotInstanceTermination") is None
    assert transition_time("") is None
