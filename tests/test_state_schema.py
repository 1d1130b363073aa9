"""The state DB's schema version: an unversioned (version 0) DB is migrated on open, rows intact;
a DB written by a newer build is refused, and `fleetd run` says so in one line and exits 2."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from fleetd.reconcile import schema
from fleetd.reconcile.journal import unsent_drains
from fleetd.reconcile.ledger_store import LedgerStore
from fleetd.reconcile.state import SCHEMA, StateStore

# The tables as the first releases created them: no version, and pool_stats without the column
# that was later added ad hoc at open.
VERSION_0 = SCHEMA.replace(
    ",\n    on_demand_capacity_error_until REAL  -- on-demand capacity error TTL (a separate shortage)", ""
)


def make_version_0(db: Path) -> None:
    assert "on_demand_capacity_error_until" not in VERSION_0
    conn = sqlite3.connect(db)
    conn.executescript(VERSION_0)
    conn.execute(
        "INSERT INTO pool_stats (pool, notices, capacity_error_until) VALUES ('g5.xlarge@us-east-1a', 2, 99.0)"
    )
    conn.execute(
        "INSERT INTO instances (instance_id, pool, market, price_per_hour, launched_at, ec2_state, first_seen_at,"
        " last_seen_at, accounted_until, drain_started_at) VALUES"
        " ('i-1', 'g5.xlarge@us-east-1a', 'spot', 0.5, 10.0, 'running', 10.0, 10.0, 10.0, 20.0)"
    )
    conn.execute("INSERT INTO meta (key, value) VALUES ('target_nodes', '3')")
    conn.commit()
    conn.close()


def user_version(db: Path) -> int:
    conn = sqlite3.connect(db)
    try:
        return conn.execute("PRAGMA user_version").fetchone()[0]
    finally:
        conn.close()


async def test_unversioned_db_is_migrated_with_its_rows(tmp_path: Path) -> None:
    make_version_0(tmp_path / "fleetd.db")
    assert user_version(tmp_path / "fleetd.db") == 0
    store = await StateStore.open(tmp_path)
    try:
        stats = await store.pool_stats()
        assert [(str(s.pool), s.notices, s.capacity_error_until, s.on_demand_capacity_error_until) for s in stats] == [
            ("g5.xlarge@us-east-1a", 2, 99.0, None)
        ]
        [row] = await store.instances()
        assert row.instance_id == "i-1" and row.drain_started_at == 20.0
        # A drain an older build recorded was recorded after it was sent: never sent again.
        assert await unsent_drains(store) == []
        assert await store.get_meta("target_nodes") == 3
    finally:
        await store.close()
    assert user_version(tmp_path / "fleetd.db") == schema.CURRENT_VERSION
    # Opening again is a no-op (and a second migration would fail on the columns it adds).
    store = await StateStore.open(tmp_path)
    await store.close()
    assert user_version(tmp_path / "fleetd.db") == schema.CURRENT_VERSION


async def test_version_0_db_that_already_had_the_ad_hoc_column_migrates(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "fleetd.db")
    conn.executescript(SCHEMA)  # version 0 written by the build that added the column at open
    conn.close()
    store = await StateStore.open(tmp_path)
    await store.close()
    assert user_version(tmp_path / "fleetd.db") == schema.CURRENT_VERSION


async def test_new_db_gets_the_current_version(tmp_path: Path) -> None:
    ledger = await LedgerStore.open(tmp_path / "fleetd.db")  # the daemon opens the ledger first
    store = await StateStore.open(tmp_path)
    await store.close()
    await ledger.close()
    assert user_version(tmp_path / "fleetd.db") == schema.CURRENT_VERSION


def make_newer(db: Path) -> None:
    conn = sqlite3.connect(db)
    conn.executescript(SCHEMA)
    conn.execute(f"PRAGMA user_version = {schema.CURRENT_VERSION + 1}")
    conn.commit()
    conn.close()


async def test_newer_db_is_refused_and_left_untouched(tmp_path: Path) -> None:
    db = tmp_path / "fleetd.db"
    make_newer(db)
    before = db.read_bytes()
    with pytest.raises(schema.SchemaTooNew, match=f"schema version {schema.CURRENT_VERSION + 1}, newer"):
        await StateStore.open(tmp_path)
    with pytest.raises(schema.SchemaTooNew):
        await LedgerStore.open(db)
    assert user_version(db) == schema.CURRENT_VERSION + 1
    conn = sqlite3.connect(db)
    assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE name='ledger_events'")] == []
    conn.close()
    assert db.read_bytes() == before


def test_fleetd_run_on_a_newer_db_exits_2_with_one_line(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    make_newer(state / "fleetd.db")
    config = tmp_path / "fleetd.toml"
    config.write_text(
        f"""
[aws]
endpoint_url = "http://127.0.0.1:9"
[fleet]
name = "t"
state_dir = {json.dumps(str(state))}
[capacity]
instance_types = ["g5.xlarge"]
zones = ["us-east-1a"]
ami_id = "ami-12345678"
[budget]
total_usd = 10.0
max_usd_per_hour = 1.0
[mqtt]
url = "mqtt://127.0.0.1:9"
[metrics]
port = 0
[logging]
json = true
"""
    )
    res = subprocess.run(
        [sys.executable, "-m", "fleetd.cli", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert "newer than this build's" in lines[0] and str(state / "fleetd.db") in lines[0]
