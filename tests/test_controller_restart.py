"""Must-show (issue 14, item 3): a real `fleetd run` SIGKILLed at a chosen instant and started
again adopts the fleet: no duplicate purchase, no orphan, the notice acted on exactly once, no
second drain of a node already draining, a decided termination carried out.

Real components: moto server behind the fault proxy, mosquitto, `fleetd run` processes, and a
real `fleet-agent run` per instance (with a fake IMDS carrying that instance's identity; the
agents do not train, so no torchrun). The kill comes from a failpoint (fleetd.shared.failpoints):
the process SIGKILLs itself at the exact instant named:

- notice-received: the notice is acknowledged to the broker, known only in memory;
- drain-recorded: the drain is in the state DB, not sent;
- drain-sent: the drain is sent, not marked sent;
- terminate-recorded: the termination is in the state DB, TerminateInstances not called.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiomqtt
import pytest

from agent.doubles.fake_imds import FakeImds
from fleetd.adapters.ec2 import TAG_LAUNCH
from fleetd.adapters.pricing import DEMO_PRICE_BOOK
from fleetd.demo.configs import trainer_socket_for
from fleetd.localnet import free_port
from fleetd.snapshot import read_snapshot
from tests.reconcile_support import ZONES, Cloud

pytestmark = pytest.mark.slow


def fleetd_toml(
    path: Path,
    cloud: Cloud,
    fleet: str,
    mqtt_url: str,
    nodes: int,
    drain_timeout_s: float = 300.0,
    max_nodes: int | None = None,
) -> Path:
    subnets = ", ".join(json.dumps(cloud.subnets[z]) for z in ZONES)
    path.write_text(f"""
[aws]
endpoint_url = "{cloud.proxy.url}"
[fleet]
name = "{fleet}"
min_nodes = {nodes}
max_nodes = {max_nodes or nodes + 1}
state_dir = "{path.parent / "state"}"
reconcile_interval_s = 0.5
[capacity]
instance_types = ["g5.xlarge", "g4dn.xlarge"]
zones = ["us-east-1a", "us-east-1b"]
ami_id = "{cloud.ami}"
subnet_ids = [{subnets}]
price_book = "{DEMO_PRICE_BOOK}"
[scaling]
initial_nodes = {nodes}
[rebalance]
drain_timeout_s = {drain_timeout_s}
[budget]
total_usd = 10000.0
max_usd_per_hour = 100.0
[mqtt]
url = "{mqtt_url}"
[rendezvous]
port = {free_port()}
[metrics]
port = 0
[logging]
json = true
""")
    return path


def fleetd_run(config: Path, log: Path, failpoint: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("FLEETD_FAILPOINTS", None)
    if failpoint:
        env["FLEETD_FAILPOINTS"] = failpoint
    return subprocess.Popen(
        [sys.executable, "-m", "fleetd.cli", "run", "--config", str(config)],
        stdout=log.open("a"),
        stderr=subprocess.STDOUT,
        env=env,
    )


class Nodes:
    """Every instance the fleet holds in EC2 becomes a fake IMDS plus a real fleet-agent."""

    def __init__(self, cloud: Cloud, fleet: str, mqtt_url: str, root: Path):
        self.cloud, self.fleet, self.mqtt_url, self.root = cloud, fleet, mqtt_url, root
        self.imds: dict[str, FakeImds] = {}
        self.agents: dict[str, subprocess.Popen] = {}

    async def run(self) -> None:
        while True:
            for inst in await self.cloud.instances(self.fleet):
                iid = inst["InstanceId"]
                if iid not in self.imds:
                    await self._start(iid, inst)
            for inst in await self.cloud.instances(self.fleet, states=("shutting-down", "terminated")):
                proc = self.agents.get(inst["InstanceId"])
                if proc is not None and proc.poll() is None:
                    proc.kill()  # the instance is gone
            await asyncio.sleep(0.5)

    async def _start(self, iid: str, inst: dict) -> None:
        fake = FakeImds(
            instance_id=iid,
            instance_type=inst["InstanceType"],
            zone=inst["Placement"]["AvailabilityZone"],
            lifecycle="spot",
        )
        url = await fake.start("127.0.0.1", 0)
        self.imds[iid] = fake
        d = self.root / iid
        d.mkdir(parents=True)
        (d / "agent.toml").write_text(f"""
[node]
fleet = "{self.fleet}"
imds_url = "{url}"
state_dir = "{d}"
trainer_socket = "{trainer_socket_for(d)}"
poll_interval_s = 0.25
shutdown_timeout_s = 5
supervise_training = false
[mqtt]
url = "{self.mqtt_url}"
keepalive_s = 5
[logging]
level = "info"
""")
        self.agents[iid] = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", "--config", str(d / "agent.toml")],
            stdout=(d / "agent.log").open("w"),
            stderr=subprocess.STDOUT,
        )

    async def close(self) -> None:
        for proc in self.agents.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.agents.values():
            try:
                await asyncio.to_thread(proc.wait, 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for fake in self.imds.values():
            await fake.stop()


async def collect_commands(host: str, port: int, fleet: str, out: list[dict]) -> None:
    async with aiomqtt.Client(host, port) as sub:
        await sub.subscribe(f"fleetd/{fleet}/nodes/+/commands", qos=1)
        async for m in sub.messages:
            out.append(json.loads(m.payload))


async def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def running_nodes(state: Path) -> list[str]:
    try:
        snap = read_snapshot(state)
    except Exception:  # noqa: BLE001 (mid-write: the next read has it)
        return []
    return [n.instance_id for n in snap.nodes if n.state == "running"] if snap else []


def db_rows(state: Path, sql: str, args: tuple = ()) -> list[tuple]:
    conn = sqlite3.connect(f"file:{state / 'fleetd.db'}?mode=ro", uri=True, timeout=5)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def drains_for(commands: list[dict], iid: str) -> list[dict]:
    return [c for c in commands if c.get("kind") == "drain" and c.get("instance_id") == iid]


async def drain_delivered(commands: list[dict], iid: str) -> None:
    """The drain the killed controller published (the broker acknowledged it) reaches the test's
    subscriber on the broker's time, not the kill's: a loaded CI run checked before it arrived."""
    await wait_for(lambda: drains_for(commands, iid), 30, f"the drain for {iid} at the subscriber")
    assert len(drains_for(commands, iid)) == 1, drains_for(commands, iid)


async def assert_fleet_consistent(cloud: Cloud, fleet: str, state: Path, max_nodes: int) -> None:
    """0 orphans (every live instance has an open record), 0 duplicates (no launch holds more
    instances than it asked for, no more active nodes than the maximum)."""
    live = await cloud.instances(fleet)
    open_rows = {r[0] for r in db_rows(state, "SELECT instance_id FROM instances WHERE ended_at IS NULL")}
    assert {i["InstanceId"] for i in live} <= open_rows, "orphan: EC2 runs an instance fleetd has no record of"
    asked = dict(db_rows(state, "SELECT token, count FROM launches"))
    by_token: dict[str, int] = {}
    for i in await cloud.instances(fleet, states=("pending", "running", "shutting-down", "terminated")):
        token = next(t["Value"] for t in i["Tags"] if t["Key"] == TAG_LAUNCH)
        by_token[token] = by_token.get(token, 0) + 1
    assert all(n <= asked.get(tok, 0) for tok, n in by_token.items()), (by_token, asked)
    assert not db_rows(state, "SELECT token FROM launches WHERE status='intent'"), "a launch left unresolved"
    leaving = {
        r[0]
        for r in db_rows(
            state,
            "SELECT instance_id FROM instances WHERE ended_at IS NULL AND"
            " (notice_at IS NOT NULL OR drain_started_at IS NOT NULL)",
        )
    }
    assert len([i for i in live if i["InstanceId"] not in leaving]) <= max_nodes


@pytest.fixture
def fleet() -> str:
    return "cr" + uuid.uuid4().hex[:8]


async def first_run_killed(proc: subprocess.Popen, log: Path, failpoint: str, timeout: float = 90) -> None:
    code = await asyncio.to_thread(proc.wait, timeout)
    assert code == -signal.SIGKILL, log.read_text()[-3000:]
    assert f'"failpoint": "{failpoint}"' in log.read_text()


async def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("failpoint", ["notice-received", "drain-sent"])
async def test_notice_in_flight_survives_a_controller_crash(
    cloud: Cloud, mosquitto, tmp_path: Path, fleet: str, failpoint: str
) -> None:
    state = tmp_path / "state"
    config = fleetd_toml(tmp_path / "fleetd.toml", cloud, fleet, mosquitto.url, nodes=2)
    nodes = Nodes(cloud, fleet, mosquitto.url, tmp_path / "nodes")
    commands: list[dict] = []
    tasks = [
        asyncio.create_task(nodes.run()),
        asyncio.create_task(collect_commands(mosquitto.host, mosquitto.port, fleet, commands)),
    ]
    log = tmp_path / "fleetd.log"
    first = fleetd_run(config, log, failpoint)
    second = None
    try:
        await wait_for(lambda: len(running_nodes(state)) == 2, 120, "two running nodes")
        victim = sorted(running_nodes(state))[0]
        nodes.imds[victim].schedule_notice(action_in_s=300)
        await first_run_killed(first, log, failpoint)
        if failpoint == "notice-received":
            assert db_rows(state, "SELECT notice_at FROM instances WHERE instance_id=?", (victim,)) == [(None,)], (
                "the crash hit before the notice was recorded"
            )
        else:
            await drain_delivered(commands, victim)
        second = fleetd_run(config, log)

        def acted() -> bool:
            rows = db_rows(
                state, "SELECT notice_at, drain_started_at, drain_sent_at FROM instances WHERE instance_id=?", (victim,)
            )
            return bool(rows) and all(v is not None for v in rows[0]) and len(running_nodes(state)) >= 2

        await wait_for(acted, 90, "the notice recorded, the drain sent, a replacement running")
        await asyncio.sleep(15)  # past the journal's re-send grace and many passes: still one drain
        drains = drains_for(commands, victim)
        assert len(drains) == 1, drains
        [(notices, losses)] = db_rows(state, "SELECT SUM(notices), SUM(losses) FROM pool_stats")
        assert (notices, losses) == (1, 0)
        assert db_rows(state, "SELECT COUNT(*) FROM ledger_events WHERE event_id=?", (f"notice:{victim}",)) == [(1,)]
        await assert_fleet_consistent(cloud, fleet, state, max_nodes=3)
        assert len(cloud.proxy.calls_of("CreateFleet")) == 2, "the first wave and one replacement"
    finally:
        for p in (first, second):
            if p is not None:
                await stop(p)
        for t in tasks:
            t.cancel()
        await nodes.close()


@pytest.mark.parametrize("failpoint", ["drain-recorded", "drain-sent", "terminate-recorded"])
async def test_drain_and_termination_survive_a_controller_crash(
    cloud: Cloud, mosquitto, tmp_path: Path, fleet: str, failpoint: str
) -> None:
    """A restart with a smaller fleet (an operator's upgrade with a new config) drains the excess
    node; the controller is killed in the middle of that drain (or of the termination after it)."""
    state = tmp_path / "state"
    log = tmp_path / "fleetd.log"
    nodes = Nodes(cloud, fleet, mosquitto.url, tmp_path / "nodes")
    commands: list[dict] = []
    tasks = [
        asyncio.create_task(nodes.run()),
        asyncio.create_task(collect_commands(mosquitto.host, mosquitto.port, fleet, commands)),
    ]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(fleetd_run(fleetd_toml(tmp_path / "fleetd.toml", cloud, fleet, mosquitto.url, nodes=2), log))
        await wait_for(lambda: len(running_nodes(state)) == 2, 120, "two running nodes")
        await stop(procs[-1])
        assert procs[-1].returncode == 0
        smaller = fleetd_toml(
            tmp_path / "fleetd-1.toml",
            cloud,
            fleet,
            mosquitto.url,
            nodes=1,
            max_nodes=1,
            # short only where the test wants the termination that follows a drain
            drain_timeout_s=4.0 if failpoint == "terminate-recorded" else 300.0,
        )
        procs.append(fleetd_run(smaller, log, failpoint))
        await first_run_killed(procs[-1], log, failpoint)
        [(victim,)] = db_rows(state, "SELECT instance_id FROM instances WHERE drain_started_at IS NOT NULL")
        if failpoint == "drain-recorded":
            assert drains_for(commands, victim) == []
        else:
            await drain_delivered(commands, victim)
        procs.append(fleetd_run(smaller, log))
        if failpoint == "terminate-recorded":

            async def gone() -> bool:
                return not any(i["InstanceId"] == victim for i in await cloud.instances(fleet))

            deadline = time.monotonic() + 90
            while not await gone():
                assert time.monotonic() < deadline, "the decided termination was never carried out"
                await asyncio.sleep(0.5)
            await wait_for(
                lambda: (
                    db_rows(state, "SELECT end_reason FROM instances WHERE instance_id=?", (victim,))
                    == [("terminated by fleetd",)]
                ),
                30,
                "the end recorded as fleetd's own",
            )
            [(losses,)] = db_rows(state, "SELECT SUM(losses) FROM pool_stats")
            assert losses == 0, "a termination fleetd decided is not an interruption"
        else:
            await wait_for(
                lambda: (
                    db_rows(state, "SELECT drain_sent_at FROM instances WHERE instance_id=?", (victim,))[0][0]
                    is not None
                ),
                60,
                "the drain marked sent",
            )
            await asyncio.sleep(15)  # past the re-send grace: still one drain
        assert len(drains_for(commands, victim)) == 1, drains_for(commands, victim)
        await assert_fleet_consistent(cloud, fleet, state, max_nodes=1)
        assert len(cloud.proxy.calls_of("CreateFleet")) == 1, "nothing bought again"
    finally:
        for p in procs:
            await stop(p)
        for t in tasks:
            t.cancel()
        await nodes.close()
