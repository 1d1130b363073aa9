"""Two real `fleetd run` processes sharing one DynamoDB table (moto server): helpers for the HA
tests and bench/failover.py. Same config file for both; only the host id and the local state
directory (status.json) differ, through the environment, as on two hosts."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fleetd.adapters.ec2 import TAG_LAUNCH
from fleetd.ha.table import DynamoTable
from fleetd.reconcile.state_dynamo import LEDGER
from fleetd.reconcile.state_mem import KINDS, StateModel
from tests.reconcile_support import Cloud
from tests.test_controller_restart import fleetd_toml

TABLE = "fleetd-ha-test"


def ha_toml(path: Path, cloud: Cloud, fleet: str, mqtt_url: str, nodes: int, lease_s: float) -> Path:
    fleetd_toml(path, cloud, fleet, mqtt_url, nodes)
    with path.open("a") as f:
        f.write(f"""
[ha]
backend = "dynamodb"
table = "{TABLE}"
lease_s = {lease_s}
endpoint_url = "{cloud.moto}"
create_table = true
""")
    return path


def host_dir(root: Path, host: str) -> Path:
    return root / f"host-{host}"


def fleetd_host(config: Path, root: Path, host: str, failpoint: str | None = None) -> subprocess.Popen:
    d = host_dir(root, host)
    d.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "FLEETD_HA__HOST_ID": host,
        "FLEETD_FLEET__STATE_DIR": str(d / "state"),
    }
    env.pop("FLEETD_FAILPOINTS", None)
    if failpoint:
        env["FLEETD_FAILPOINTS"] = failpoint
    return subprocess.Popen(
        [sys.executable, "-m", "fleetd.cli", "run", "--config", str(config)],
        stdout=(d / "fleetd.log").open("a"),
        stderr=subprocess.STDOUT,
        env=env,
    )


def log_events(root: Path, host: str, event: str) -> list[dict]:
    out = []
    path = host_dir(root, host) / "fleetd.log"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if f'"{event}"' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == event:
            out.append(rec)
    return out


def log_tail(root: Path, host: str, n: int = 3000) -> str:
    path = host_dir(root, host) / "fleetd.log"
    return path.read_text()[-n:] if path.exists() else ""


async def wait_until(predicate: Any, timeout: float, what: str, every: float = 0.25) -> float:
    """Poll a (sync or async) predicate; returns the monotonic time it became true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return time.monotonic()
        await asyncio.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


async def shared_state(cloud: Cloud, fleet: str) -> tuple[StateModel, list[dict]]:
    """What a new leader would read: the rows and the ledger in DynamoDB."""
    async with cloud.session.create_client("dynamodb", endpoint_url=cloud.moto, region_name="us-east-1") as c:
        table = DynamoTable(c, TABLE, fleet)
        rows = {kind: await table.query(kind) for kind in KINDS}
        ledger = await table.query(LEDGER)
    return StateModel(rows), [ledger[k] for k in sorted(ledger)]


async def assert_no_orphan_no_duplicate(cloud: Cloud, fleet: str, max_nodes: int) -> None:
    """0 orphans (every live EC2 instance has an open row in the shared state), 0 duplicate
    launches (no launch token holds more instances than it asked for; no open intent left)."""
    model, _ = await shared_state(cloud, fleet)
    live = await cloud.instances(fleet)
    open_rows = {i for i, r in model.instances.items() if r["ended_at"] is None}
    assert {i["InstanceId"] for i in live} <= open_rows, "orphan: EC2 runs an instance the shared state does not know"
    asked = {t: r["count"] for t, r in model.launches.items()}
    by_token: dict[str, int] = {}
    for i in await cloud.instances(fleet, states=("pending", "running", "shutting-down", "terminated")):
        token = next(t["Value"] for t in i["Tags"] if t["Key"] == TAG_LAUNCH)
        by_token[token] = by_token.get(token, 0) + 1
    assert all(n <= asked.get(tok, 0) for tok, n in by_token.items()), (by_token, asked)
    assert not [t for t, r in model.launches.items() if r["status"] == "intent"], "a launch left unresolved"
    leaving = {
        i
        for i, r in model.instances.items()
        if r["ended_at"] is None and (r["notice_at"] is not None or r["drain_started_at"] is not None)
    }
    assert len([i for i in live if i["InstanceId"] not in leaving]) <= max_nodes


async def retained_endpoint(host: str, port: int, fleet: str, timeout: float = 5.0) -> Any:
    """The retained rendezvous endpoint the broker holds for the fleet (None: none)."""
    import aiomqtt

    from fleetd.protocol.messages import parse_endpoint
    from fleetd.protocol.topics import rendezvous_topic

    async with aiomqtt.Client(host, port) as sub:
        await sub.subscribe(rendezvous_topic(fleet), qos=1)
        try:
            async with asyncio.timeout(timeout):
                async for m in sub.messages:
                    return parse_endpoint(m.payload)
        except TimeoutError:
            return None
