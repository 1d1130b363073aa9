"""Must-show: fleetd dies between "EC2 launched" and "fleetd recorded it"; a restart neither buys
twice nor leaves an instance behind, and its state matches EC2.

The fault proxy forwards CreateFleet to moto (so the instances exist) but holds the answer; the
controller is killed while it waits for it, exactly the window a crash would hit.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetd.adapters.ec2 import TAG_LAUNCH
from fleetd.policy.planner import plan
from fleetd.reconcile import state as st
from fleetd.reconcile.build import build_reconciler
from fleetd.reconcile.state import StateStore
from tests.reconcile_support import ZONES, Cloud, FakeClock


async def assert_state_matches_ec2(cloud: Cloud, state_dir: Path, expected: int) -> None:
    live = await cloud.instances()
    assert len(live) == expected, "no duplicate purchase, no missing node"
    store = await StateStore.open(state_dir)
    try:
        launches = await store.launches()
        rows = await store.instances()
    finally:
        await store.close()
    assert [row.status for row in launches] == [st.LAUNCHED], "the one launch is settled, nothing left open"
    assert sorted(launches[0].instance_ids) == sorted(i["InstanceId"] for i in live)
    assert sorted(row.instance_id for row in rows) == sorted(i["InstanceId"] for i in live), "no orphan"
    tokens = {t["Value"] for i in live for t in i["Tags"] if t["Key"] == TAG_LAUNCH}
    assert tokens == {launches[0].token}


async def test_cancelled_between_launch_and_record_then_restart_adopts(cloud: Cloud, tmp_path: Path) -> None:
    clock = FakeClock(time.time())
    cfg = cloud.config(tmp_path)
    hold = cloud.proxy.hold("CreateFleet")
    async with cloud.client() as client, cloud.pricing_client() as pricing:
        built = await build_reconciler(cfg, client, planner=plan, clock=clock, pricing_client=pricing)
        task = asyncio.create_task(built.reconciler.run(asyncio.Event()))
        assert await asyncio.to_thread(hold.arrived.wait, 20), "CreateFleet never reached EC2"
        assert len(await cloud.instances()) == 3  # bought on EC2 ...
        task.cancel()  # ... and the controller goes away before it hears about it
        with pytest.raises(asyncio.CancelledError):
            await task
        # Only then does EC2 answer: the call runs in the cloud-call task, which could otherwise
        # hear the answer and record it in the loop turn before the cancellation reaches it.
        hold.release.set()
        await built.close()
    store = await StateStore.open(tmp_path)
    assert [row.status for row in await store.launches()] == [st.OPEN]  # intent written, never settled
    await store.close()

    async with cloud.client() as client, cloud.pricing_client() as pricing:
        built = await build_reconciler(cfg, client, planner=plan, clock=clock, pricing_client=pricing)
        for _ in range(3):
            report = await built.reconciler.run_pass()
            assert report.error is None and not report.outcomes
            clock.advance(1)
        await built.close()
    assert len(cloud.proxy.calls_of("CreateFleet")) == 1
    await assert_state_matches_ec2(cloud, tmp_path, 3)


def write_config(cloud: Cloud, tmp_path: Path) -> Path:
    state_dir = tmp_path / "state"
    subnets = ", ".join(json.dumps(cloud.subnets[z]) for z in ZONES)
    path = tmp_path / "fleetd.toml"
    path.write_text(
        f"""
[aws]
endpoint_url = "{cloud.proxy.url}"
[fleet]
name = "t"
min_nodes = 3
max_nodes = 3
state_dir = "{state_dir}"
reconcile_interval_s = 0.5
[capacity]
instance_types = ["g5.xlarge", "g4dn.xlarge"]
zones = ["us-east-1a", "us-east-1b"]
ami_id = "{cloud.ami}"
subnet_ids = [{subnets}]
[budget]
total_usd = 10000.0
max_usd_per_hour = 100.0
[logging]
json = true
"""
    )
    return path


def fleetd_run(config: Path, log_path: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fleetd.cli", "run", "--config", str(config), *extra],
        stdout=log_path.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def log_events(log_path: Path) -> list[str]:
    out = []
    for line in log_path.read_text().splitlines():
        try:
            out.append(json.loads(line).get("event", ""))
        except json.JSONDecodeError:
            continue
    return out


async def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
async def test_sigkill_between_launch_and_record_then_restarted_daemon_adopts(cloud: Cloud, tmp_path: Path) -> None:
    config = write_config(cloud, tmp_path)
    hold = cloud.proxy.hold("CreateFleet")
    first = fleetd_run(config, tmp_path / "first.log")
    try:
        assert await asyncio.to_thread(hold.arrived.wait, 60), (tmp_path / "first.log").read_text()
        assert len(await cloud.instances()) == 3
        first.send_signal(signal.SIGKILL)
        assert await asyncio.to_thread(first.wait, 10) == -signal.SIGKILL
    finally:
        hold.release.set()
        if first.poll() is None:
            first.kill()
            first.wait()

    # Restart the real daemon; it adopts the three by their launch tag, buys nothing, and shuts
    # down cleanly on SIGTERM.
    second = fleetd_run(config, tmp_path / "second.log")
    try:

        async def adopted() -> bool:
            return "launch_adopted" in log_events(tmp_path / "second.log")

        await wait_for(adopted, 60, "the restarted daemon to adopt the launch")
        await asyncio.sleep(1.5)  # a few more passes: still nothing to buy
        second.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(second.wait, 30) == 0
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    events = log_events(tmp_path / "second.log")
    assert "daemon_stopped" in events and "launched" not in events
    assert len(cloud.proxy.calls_of("CreateFleet")) == 1
    await assert_state_matches_ec2(cloud, tmp_path / "state", 3)
