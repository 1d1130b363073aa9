"""`fleetd status`: reads the snapshot the daemon writes (or fleetd.db), as a table or JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fleetd.commands.status import budget_bar, collect
from fleetd.policy.model import BudgetLevel, BudgetStatus, Market, Node, NodePhase, PoolId
from fleetd.protocol.errors import ProtocolError
from fleetd.snapshot import SNAPSHOT_VERSION, build_snapshot, read_snapshot, snapshot_path, write_snapshot

FLEETD = str(Path(sys.executable).parent / "fleetd")
A = PoolId("g5.xlarge", "us-east-1a")
B = PoolId("g6.xlarge", "us-east-1b")


def fleetd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([FLEETD, *args], capture_output=True, text=True, timeout=60)


def sample_snapshot(now: float, **overrides):
    nodes = [
        Node(
            "i-0aaa",
            A,
            Market.SPOT,
            0.41,
            now - 600,
            phase=NodePhase.RUNNING,
            gpu_util_pct=87.0,
            steps_per_s=2.5,
            step=1200,
        ),
        Node("i-0bbb", B, Market.ON_DEMAND, 1.01, now - 300, phase=NodePhase.DRAINING, notice_at=now - 5),
        Node("i-0ccc", A, Market.SPOT, 0.40, now - 900, phase=NodePhase.TERMINATED, ec2_state="terminated"),
    ]
    kwargs = dict(
        now=now,
        fleet="prod",
        reconcile_interval_s=10.0,
        nodes=nodes,
        target_nodes=2,
        budget=BudgetStatus(
            level=BudgetLevel.WARN,
            spent_usd=85.0,
            burn_usd_per_hour=1.42,
            forecast_usd=92.0,
            reason="forecast above warn_at",
        ),
        budget_total_usd=100.0,
        budget_max_usd_per_hour=5.0,
        rendezvous=(6, 2),
        checkpoint=(1100, now - 40),
        node_checkpoints={"i-0aaa": (1100, now - 42)},
    )
    kwargs.update(overrides)
    return build_snapshot(**kwargs)


def test_json_from_the_snapshot(tmp_path):
    now = time.time()
    write_snapshot(tmp_path, sample_snapshot(now))
    result = fleetd("status", "--state-dir", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["source"] == "snapshot" and report["fleet"] == "prod" and not report["stale"]
    assert report["node_count"] == 2  # the terminated node is listed but not counted
    assert report["nodes_by_state"] == {"running": 1, "draining": 1} and report["spot_nodes"] == 1
    first = next(n for n in report["nodes"] if n["instance_id"] == "i-0aaa")
    assert (first["pool"], first["market"], first["price_per_hour"]) == (str(A), "spot", 0.41)
    assert (first["gpu_util_pct"], first["steps_per_s"], first["last_checkpoint_step"]) == (87.0, 2.5, 1100)
    assert report["rendezvous"] == {"round": 6, "world_size": 2}
    assert report["budget"]["left_usd"] == 15.0
    assert report["budget"]["hours_to_cap"] == pytest.approx(15.0 / 1.42, abs=0.01)
    assert report["checkpoint"]["step"] == 1100 and 39 <= report["checkpoint"]["age_s"] <= 100


def test_table_with_budget_bar_and_forecast(tmp_path):
    write_snapshot(tmp_path, sample_snapshot(time.time()))
    result = fleetd("status", "--state-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "fleet prod: 2 live node(s), target 2" in out
    assert "i-0aaa" in out and "g5.xlarge@us-east-1a" in out and "87" in out
    assert "rendezvous: round 6, world size 2" in out
    assert budget_bar(85, 100) in out and "$15.00 left" in out and "cap in 10.6 h" in out
    assert "STALE" not in out


def test_budget_bar_bounds():
    assert budget_bar(0, 100, width=10) == "[----------] 0%"
    assert budget_bar(50, 100, width=10) == "[#####-----] 50%"
    assert budget_bar(150, 100, width=10) == "[##########] 100%"


def test_stale_snapshot_is_flagged(tmp_path):
    write_snapshot(tmp_path, sample_snapshot(time.time() - 600))
    report = collect(tmp_path, now=time.time())
    assert report["stale"] is True
    assert "STALE" in fleetd("status", "--state-dir", str(tmp_path)).stdout


def test_reads_the_state_dir_from_the_config(tmp_path):
    state = tmp_path / "state"
    write_snapshot(state, sample_snapshot(time.time()))
    config = tmp_path / "fleetd.toml"
    config.write_text(f'[fleet]\nname = "prod"\nstate_dir = "{state}"\n')
    result = fleetd("status", "--config", str(config), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["node_count"] == 2
    bad = tmp_path / "bad.toml"
    bad.write_text("[fleet]\nstate_dirr = '/x'\n")
    result = fleetd("status", "--config", str(bad))
    assert result.returncode == 2 and "fleet.state_dirr" in result.stderr


def test_no_state_and_unreadable_state_are_clear_errors(tmp_path):
    result = fleetd("status", "--state-dir", str(tmp_path))
    assert result.returncode == 1 and "no state" in result.stderr
    snapshot_path(tmp_path).write_text(json.dumps({"schema_version": SNAPSHOT_VERSION + 1}))
    with pytest.raises(ProtocolError):
        read_snapshot(tmp_path)
    result = fleetd("status", "--state-dir", str(tmp_path))
    assert result.returncode == 1 and "newer than this fleetd" in result.stderr


async def test_falls_back_to_fleetd_db_before_the_first_snapshot(tmp_path):
    from fleetd.reconcile.state import SeenInstance, StateStore

    store = await StateStore.open(tmp_path)
    try:
        now = time.time()
        seen = [
            SeenInstance("i-0aaa", A, Market.SPOT, "running", now - 60, "tok", 0.41),
            SeenInstance("i-0bbb", B, Market.ON_DEMAND, "pending", now - 5, "tok", 1.01),
        ]
        await store.sync_instances(seen, now)
        # The daemon keeps its connection open (WAL): status reads alongside it.
        report = collect(tmp_path, now=now, fleet="prod")
    finally:
        await store.close()
    assert report["source"] == "database" and report["node_count"] == 2
    assert {n["instance_id"]: n["price_per_hour"] for n in report["nodes"]} == {"i-0aaa": 0.41, "i-0bbb": 1.01}


def test_readers_never_see_a_partial_snapshot(tmp_path):
    """The daemon rewrites the file every pass; concurrent readers see one whole version or another."""
    stop = threading.Event()
    errors: list[Exception] = []

    def writer() -> None:
        i = 0
        while not stop.is_set():
            write_snapshot(tmp_path, sample_snapshot(1000.0 + i))
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        reads = 0
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                if read_snapshot(tmp_path) is not None:
                    reads += 1
            except ProtocolError as exc:
                errors.append(exc)
    finally:
        stop.set()
        t.join()
    assert not errors and reads > 10
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".status-")], "temporary files left behind"


def test_gpu_idle_and_input_bound_nodes_are_named_with_the_reason(tmp_path):
    now = time.time()
    flags = {
        "i-0aaa": "input-bound: GPU 12% while the host CPU is at 97% (data loading or preprocessing keeps the GPUs waiting)"
    }
    write_snapshot(tmp_path, sample_snapshot(now, flags=flags))
    result = fleetd("status", "--state-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"i-0aaa: {flags['i-0aaa']}" in result.stdout
    report = json.loads(fleetd("status", "--state-dir", str(tmp_path), "--json").stdout)
    assert {n["instance_id"]: n["flag"] for n in report["nodes"]} == {
        "i-0aaa": flags["i-0aaa"],
        "i-0bbb": None,
        "i-0ccc": None,
    }


def test_a_teams_job_shows_its_allotment_and_a_pause_says_so(tmp_path):
    from fleetd.commands.status import render
    from fleetd.policy.team_model import TeamActionKind
    from fleetd.team.allotment_file import AllotmentRecord, write_allotment

    NOW = 1_800_000_000.0

    write_snapshot(tmp_path, build_snapshot(now=NOW, fleet="f", reconcile_interval_s=10.0, nodes=[]))
    report = collect(tmp_path, now=NOW + 5)
    assert report["team"] is None and "team" not in render(report)
    paused = AllotmentRecord(
        team="lab",
        job="f",
        written_at=NOW,
        kind="pause",
        nodes=0,
        usd_per_hour=0.0,
        total_usd=3.5,
        reason="its need of 1 nodes does not fit the team budget",
        paused_at=NOW,
    )
    write_allotment(tmp_path, paused)
    report = collect(tmp_path, now=NOW + 5)
    assert report["team"]["kind"] == "pause" and report["team"]["age_s"] == 5.0
    assert "team lab: PAUSED, $3.50 in all (allotted 5 s ago): its need of 1 nodes" in render(report)
    keep = paused.model_copy(update={"kind": TeamActionKind.KEEP, "nodes": 2, "usd_per_hour": 0.8, "reason": "keep"})
    write_allotment(tmp_path, keep)
    assert "team lab: KEEP, 2 node(s) at most $0.80/h, $3.50 in all" in render(collect(tmp_path, now=NOW + 5))
    # Moved to another region by the team: the status says where it runs and where it came from.
    from fleetd.team.region_file import RegionRecord, write_region

    write_region(
        tmp_path,
        RegionRecord(job="f", region="us-west-2", moved_from="us-east-1", moved_at=NOW, objects=5, bytes=9, copy_s=0.2),
    )
    assert "region us-west-2: moved from us-east-1 by the team (5 objects copied in 0.2 s)" in render(
        collect(tmp_path, now=NOW + 5)
    )


def test_a_team_member_with_no_allotment_yet_says_it_waits_for_one(tmp_path):
    from fleetd.commands.status import render

    NOW = 1_800_000_000.0
    write_snapshot(tmp_path, build_snapshot(now=NOW, fleet="f", reconcile_interval_s=10.0, nodes=[], team_member=True))
    report = collect(tmp_path, now=NOW + 5)
    assert report["team"] == {"waiting": True}
    assert "team: WAITING for its first allotment (is fleetd-team running?)" in render(report)
