"""HA failover: how long a fleet is without a leader when the leader's `fleetd run` is SIGKILLed.

Two real `fleetd run` (DynamoDB backend on moto server, EC2 through the fault proxy, a real
mosquitto; the same code path as tests/test_ha_failover.py) share one fleet of ``--nodes`` nodes.
``--trials`` times the current leader is SIGKILLed at a random moment, the standby takes over,
and the killed host is started again as the new standby. Per trial:

- takeover: the kill -> the standby's ``leading`` line (lease expiry by its own clock, the lease
  write, the shared state read again); the design's bound is ``lease_s`` + one lease step;
- first pass: the kill -> the new leader's first reconcile pass done (its status.json written);
- after every trial: EC2 instances not in the shared state (orphans) and launches holding more
  instances than they asked for (duplicates) are counted.

Prints one line per trial, and as the last line one JSON object.
Run: ``.venv/bin/python bench/failover.py --trials 3``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aiobotocore.session import get_session  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402

from fleetd.snapshot import read_snapshot  # noqa: E402
from tests.ha_procs import assert_no_orphan_no_duplicate, fleetd_host, ha_toml, host_dir, log_events, wait_until  # noqa: E402
from tests.harness import moto as moto_harness  # noqa: E402
from tests.harness.mosquitto import Mosquitto  # noqa: E402
from tests.reconcile_support import make_cloud  # noqa: E402


def stamp(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def pass_written_after(root: Path, host: str, t: float) -> bool:
    try:
        snap = read_snapshot(host_dir(root, host) / "state")
    except Exception:  # noqa: BLE001 (mid-write)
        return False
    return snap is not None and snap.written_at > t


async def main(args: argparse.Namespace) -> dict:
    moto_harness.use_fake_credentials()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    broker = Mosquitto().start()
    cloud = await make_cloud(f"http://{host}:{port}", get_session())
    root = Path(tempfile.mkdtemp(prefix="fleetd-failover-"))
    fleet = "bench" + os.urandom(3).hex()
    config = ha_toml(root / "fleetd.toml", cloud, fleet, broker.url, nodes=args.nodes, lease_s=args.lease_s)
    procs = {"a": fleetd_host(config, root, "a")}
    trials = []
    try:
        await wait_until(lambda: log_events(root, "a", "leading"), 180, "a to lead")
        procs["b"] = fleetd_host(config, root, "b")
        await wait_until(lambda: log_events(root, "b", "daemon_started"), 180, "b to stand by")

        async def fleet_up() -> bool:
            return len(await cloud.instances(fleet, states=("running",))) == args.nodes

        await wait_until(fleet_up, 180, "the fleet running")
        leader, standby = "a", "b"
        for n in range(args.trials):
            await asyncio.sleep(random.uniform(args.lease_s / 3, args.lease_s))
            before = len(log_events(root, standby, "leading"))
            load = os.getloadavg()[0]
            killed_at = time.time()
            procs[leader].send_signal(signal.SIGKILL)
            procs[leader].wait()
            await wait_until(lambda s=standby, b=before: len(log_events(root, s, "leading")) > b, 120, "takeover")
            took = stamp(log_events(root, standby, "leading")[-1])
            await wait_until(
                lambda s=standby, t=took: pass_written_after(root, s, t), 120, "the new leader's first pass"
            )
            # status.json is written after the pass: its mtime is when the first pass had finished.
            first_pass = (host_dir(root, standby) / "state" / "status.json").stat().st_mtime
            await wait_until(fleet_up, 120, "the fleet running")
            try:
                await assert_no_orphan_no_duplicate(cloud, fleet, max_nodes=args.nodes)
                consistent = True
            except AssertionError as exc:
                consistent = False
                print(f"inconsistent after trial {n}: {exc}", file=sys.stderr)
            row = {
                "trial": n,
                "leader_killed": leader,
                "takeover_s": round(took - killed_at, 2),
                "first_pass_s": round(first_pass - killed_at, 2),
                "consistent": consistent,
                "load_1m": round(load, 1),
            }
            trials.append(row)
            print(json.dumps(row), flush=True)
            started = len(log_events(root, leader, "daemon_started"))
            procs[leader] = fleetd_host(config, root, leader)  # back as the standby
            await wait_until(
                lambda h=leader, s=started: len(log_events(root, h, "daemon_started")) > s,
                180,
                "the killed host back as the standby",
            )
            leader, standby = standby, leader
        creates = len(cloud.proxy.calls_of("CreateFleet"))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(30)
            except Exception:  # noqa: BLE001
                p.kill()
        cloud.proxy.stop()
        broker.stop()
        server.stop()
    takeovers = [t["takeover_s"] for t in trials]
    return {
        "bench": "failover",
        "trials": len(trials),
        "nodes": args.nodes,
        "lease_s": args.lease_s,
        "reconcile_interval_s": 0.5,
        "bound_s": args.lease_s + 2 * args.lease_s / 8,  # lease + two standby polls (DESIGN)
        "takeover_s": takeovers,
        "takeover_median_s": statistics.median(takeovers) if takeovers else None,
        "first_pass_s": [t["first_pass_s"] for t in trials],
        "all_consistent": all(t["consistent"] for t in trials),
        "create_fleet_calls": creates,
        "note": "2-core box shared with other work; load_1m per trial",
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--lease-s", type=float, default=8.0)
    result = asyncio.run(main(p.parse_args()))
    print(json.dumps(result))
