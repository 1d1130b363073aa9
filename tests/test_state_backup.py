"""The state DB's backup to the checkpoint bucket (fleetd/state_backup.py), against moto server:
the live DB (written by the real LedgerStore, WAL mode, still open) is copied online, and a
control host that lost its disk gets the spend back at start instead of a budget from 0."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from fleetd import state_backup
from fleetd.config import FleetdConfig
from fleetd.policy.ledger_events import InstanceStarted, InstanceStopped
from fleetd.policy.model import Market, PoolId
from fleetd.reconcile.ledger_store import DB_NAME, LedgerStore

A = PoolId("g5.xlarge", "us-east-1a")
T0 = 1_800_000_000.0


def config(tmp: Path, endpoint: str, interval_s: float = 300.0) -> FleetdConfig:
    return FleetdConfig.model_validate(
        {
            "fleet": {"name": "f1", "state_dir": str(tmp), "state_backup_interval_s": interval_s},
            "checkpoints": {"bucket": "ckpt", "prefix": "checkpoints"},
            "aws": {"endpoint_url": endpoint, "region": "us-east-1"},
        }
    )


class Ctx:
    def __init__(self) -> None:
        self.stopping = asyncio.Event()


@pytest.fixture
async def bucket(moto_endpoint: str, tmp_path: Path) -> str:
    async with state_backup.open_s3(config(tmp_path, moto_endpoint)) as s3:
        await s3.create_bucket(Bucket="ckpt")
    return moto_endpoint


async def test_backup_of_the_live_db_restores_the_spend_on_a_new_disk(bucket: str, tmp_path: Path):
    live_dir, new_disk = tmp_path / "host", tmp_path / "new-host"
    ledger = await LedgerStore.open(live_dir / DB_NAME)
    try:
        await ledger.append(InstanceStarted(T0, "i-1", A, Market.SPOT, 0.36, 1.0, event_id="start-i-1"))
        cfg = config(live_dir, bucket)
        async with state_backup.open_s3(cfg) as s3:
            backup = state_backup.StateBackup(cfg, 300.0, s3=s3)
            assert await backup.once()
            assert not await backup.once(), "uploaded again although nothing changed"
            await ledger.append(InstanceStopped(T0 + 3600, "i-1", event_id="stop-i-1"))
            assert await backup.once() and backup.uploads == 2  # the ledger moved: a new copy
            spent = await ledger.spent_usd(T0 + 7200)
            key = state_backup.backup_key(cfg)
            assert key == "_fleetd-state/f1/fleetd.db"  # outside the nodes' writable prefix
            head = await s3.head_object(Bucket="ckpt", Key=key)
            assert head["ContentLength"] > 0
    finally:
        await ledger.close()

    # The control host's disk is gone: `fleetd run` on a new one restores before opening the DB.
    cfg2 = config(new_disk, bucket)
    assert await state_backup.restore_at_start(cfg2)
    restored = await LedgerStore.open(new_disk / DB_NAME)
    try:
        assert spent > 0 and await restored.spent_usd(T0 + 7200) == pytest.approx(spent)
        assert len(await restored.events()) == 2
    finally:
        await restored.close()
    # ...and never over a DB that exists
    assert not await state_backup.restore_at_start(cfg2)


async def test_no_backup_yet_starts_a_new_db_and_a_corrupt_one_is_refused(bucket: str, tmp_path: Path):
    cfg = config(tmp_path / "a", bucket)
    assert not await state_backup.restore_at_start(cfg)
    assert not (tmp_path / "a" / DB_NAME).exists()
    async with state_backup.open_s3(cfg) as s3:
        await s3.put_object(Bucket="ckpt", Key=state_backup.backup_key(cfg), Body=b"not a database" * 100)
    assert not await state_backup.restore_at_start(cfg)
    assert not (tmp_path / "a" / DB_NAME).exists()


async def test_backups_off_never_touch_s3(tmp_path: Path):
    cfg = config(tmp_path, "http://127.0.0.1:9", interval_s=0)  # nothing listens there
    assert not await state_backup.restore_at_start(cfg)


async def test_the_daemon_component_backs_up_then_stops(bucket: str, tmp_path: Path):
    ledger = await LedgerStore.open(tmp_path / DB_NAME)
    try:
        await ledger.append(InstanceStarted(T0, "i-1", A, Market.SPOT, 0.36, 1.0, event_id="start-i-1"))
        cfg = config(tmp_path, bucket, interval_s=0.2)
        ctx = Ctx()
        task = asyncio.create_task(state_backup.StateBackup(cfg, 0.2).run(ctx))
        async with state_backup.open_s3(cfg) as s3:
            for _ in range(100):
                try:
                    obj = await s3.get_object(Bucket="ckpt", Key=state_backup.backup_key(cfg))
                    data = await obj["Body"].read()
                    break
                except s3.exceptions.NoSuchKey:
                    await asyncio.sleep(0.1)
            else:
                raise AssertionError("no backup uploaded")
        ctx.stopping.set()
        await asyncio.wait_for(task, 10)
        copy = tmp_path / "copy.db"
        copy.write_bytes(data)
        db = sqlite3.connect(copy)
        try:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        finally:
            db.close()
    finally:
        await ledger.close()
