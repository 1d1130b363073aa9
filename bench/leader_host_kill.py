"""HA failover with the leader host's whole process tree SIGKILLed while the job trains.

Two control hosts, each one process group (`fleetd rendezvous` + `fleetd run`, as the two
systemd units of one machine), share their state in DynamoDB (moto server); EC2 goes through
the fault proxy with the production price path; a real mosquitto. Every instance fleetd buys
becomes a local node (the demo's Launcher: a fake IMDS + a real `fleet-agent run`, which runs
real torchrun on CPU/gloo, the toy trainer, checkpoints replicated on every node and in S3).

``--trials`` times, once every rank trains, the leading host's group is SIGKILLed (its
controller, its steering, its rendezvous store: everything it runs, at one instant). The
standby takes the lease, publishes its own store's endpoint (retained), every agent restarts
torchrun against it once, and training resumes. The killed host then comes back as the new
standby, so the next trial kills the other one. Per trial:

- takeover_s: the kill -> the standby's ``leading`` line;
- published_s: the kill -> its ``rendezvous_endpoint_published`` line;
- training_again_s: the kill -> every rank has completed a step in a world of ``--nodes``
  formed on the new store;
- longest_pause_s: the longest gap between rank 0's consecutive steps around the failover
  (training rides through the store's death until torchrun is moved to the new store);
- steps_lost: the highest step completed before torchrun was restarted (training rides through
  the store's death until the endpoint moves) minus the step the new world resumed from;
- endpoint_restarts: per agent, how often it moved torchrun (must be 1 per trial);
- survivors: processes of the killed host's group still alive after the kill (must be none);
- after every trial: EC2 instances not in the shared state (orphans), launches holding more
  instances than they asked for (duplicates), and instances launched beyond the first wave.

Prints one line per trial, and as the last line one JSON object. ``--quick`` is the test's
mode (tests/test_leader_host_kill.py): one trial.
Run: ``PYTHONPATH=$PWD nice .venv/bin/python bench/leader_host_kill.py --trials 3``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
from aiobotocore.session import get_session  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402

from bench.chaos_checks import strays  # noqa: E402
from fleetd.adapters.faults import FaultProxy  # noqa: E402
from fleetd.demo import configs  # noqa: E402
from fleetd.demo.launcher import Launcher, template_job_env  # noqa: E402
from fleetd.demo.procs import Child  # noqa: E402
from fleetd.demo.progress import Progress  # noqa: E402
from fleetd.localnet import free_port, wait_port_async  # noqa: E402
from tests.ha_procs import TABLE, assert_no_orphan_no_duplicate, host_dir, log_events, wait_until  # noqa: E402
from tests.harness import moto as moto_harness  # noqa: E402
from tests.harness.mosquitto import Mosquitto  # noqa: E402
from tests.reconcile_support import Cloud  # noqa: E402

FLEET = configs.DEMO_FLEET
MARKER = "FLEETD_BENCH_LEADER_KILL"  # every process the bench starts inherits it (stray check)


def stamp(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


class ControlHost:
    """One control host: its store and its controller in one process group, so that a SIGKILL
    to the group is the machine going away (nothing on it gets a chance to react)."""

    def __init__(self, name: str, root: Path, config: Path, port: int):
        self.name, self.root, self.config, self.port = name, root, config, port
        self.child: Child | None = None

    async def start(self) -> None:
        d = host_dir(self.root, self.name)
        d.mkdir(parents=True, exist_ok=True)
        py, conf = shlex.quote(sys.executable), shlex.quote(str(self.config))
        store_log = shlex.quote(str(d / "rendezvous.log"))
        # The store in the background, the controller exec'd in its place: one group, one tree.
        script = (
            f"{py} -m fleetd.cli rendezvous --config {conf} >> {store_log} 2>&1 & "
            f"exec {py} -m fleetd.cli run --config {conf}"
        )
        env = {
            "PYTHONUNBUFFERED": "1",
            "FLEETD_HA__HOST_ID": self.name,
            "FLEETD_HA__ADVERTISE_HOST": "127.0.0.1",
            "FLEETD_RENDEZVOUS__PORT": str(self.port),
            "FLEETD_FLEET__STATE_DIR": str(d / "state"),
        }
        self.child = await Child.start(f"host-{self.name}", ["/bin/sh", "-c", script], d / "fleetd.log", env=env)

    def members(self) -> list[psutil.Process]:
        assert self.child is not None
        pgid = self.child.proc.pid
        out = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == pgid:
                    out.append(p)
            except (ProcessLookupError, psutil.Error, OSError):
                continue
        return out

    async def kill(self) -> tuple[int, list[str]]:
        """SIGKILL the whole group at one instant. Returns (processes killed, survivors)."""
        assert self.child is not None
        members = self.members()
        self.child.signal_group(signal.SIGKILL)
        await self.child.proc.wait()
        await asyncio.sleep(0.5)
        alive = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in members if _alive(p)]
        return len(members), alive

    async def stop(self) -> None:
        if self.child is not None:
            await self.child.stop(timeout=15.0)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def agent_events(root: Path, event: str) -> dict[str, int]:
    """Per node: how many ``event`` lines its agent logged."""
    out = {}
    for log in sorted((root / "nodes").glob("*/agent.log")):
        out[log.parent.name] = sum(1 for line in log.read_text(errors="replace").splitlines() if f'"{event}"' in line)
    return out


def trial_outcome(events: Path, t_kill: float, nodes: int) -> dict | None:
    """Once every rank trains again on the new store: when, and what it cost in steps."""
    recs = Progress.load(events).records
    resumed = [r for r in recs if r["ev"] == "resumed" and r["t"] > t_kill]
    if not resumed:
        return None
    first = resumed[0]["t"]
    again = Progress(recs).training_again_at(first, world=nodes)
    if again is None:
        return None
    # Every resumption up to the moment the whole world trains again: the worst one counts.
    froms = [int(r["from_step"]) for r in resumed if r["t"] <= again]
    before = max((int(r["step"]) for r in recs if r["ev"] == "step" and r["t"] < first), default=0)
    at_kill = max((int(r["step"]) for r in recs if r["ev"] == "step" and r["t"] < t_kill), default=0)
    # Training rides through the store's death (gloo needs no store between steps) until torchrun
    # is moved: the longest pause between one rank's consecutive steps is what the job really stood.
    times = sorted(r["t"] for r in recs if r["ev"] == "step" and r.get("rank") == 0 and t_kill - 5 <= r["t"] <= again)
    pause = max((b - a for a, b in pairwise(times)), default=None)
    return {
        "training_again_s": round(again - t_kill, 2),
        "longest_pause_s": round(pause, 2) if pause else None,
        "step_at_kill": at_kill,
        "step_at_restart": before,
        "resumed_from": min(froms),
        "steps_lost": max(0, before - min(froms)),
    }


async def main(args: argparse.Namespace) -> dict:
    moto_harness.use_fake_credentials()
    os.environ[MARKER] = str(os.getpid())
    os.environ["PYTHONUNBUFFERED"] = "1"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    moto_url = "http://{}:{}".format(*server.get_host_and_port())
    broker = Mosquitto().start()
    price_list, spot_prices = configs.demo_price_fakes()
    proxy = FaultProxy(moto_url, price_list=price_list, spot_prices=spot_prices).start()
    session = get_session()
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="fleetd-leaderkill-"))
    root.mkdir(parents=True, exist_ok=True)
    events = root / "trainer-events.jsonl"
    aws = {"endpoint_url": moto_url, "region_name": "us-east-1"}
    async with session.create_client("s3", **aws) as s3:
        await s3.create_bucket(Bucket=configs.DEMO_BUCKET)
    async with session.create_client("ec2", **aws) as ec2:
        named = {"Name": "name", "Values": ["amzn2-ami-hvm-2.0*"]}
        ami = (await ec2.describe_images(Owners=["amazon"], Filters=[named]))["Images"][0]["ImageId"]
    cloud = Cloud(moto_url, proxy, session, ami, {})
    ports = {"a": free_port(), "b": free_port()}
    ep = configs.DemoEndpoints(aws_url=proxy.url, s3_url=moto_url, mqtt_url=broker.url, rdzv_port=ports["a"])
    config = configs.fleetd_toml(
        root,
        ep,
        args.nodes,
        100.0,
        50.0,
        ami,
        overrides={
            "ha": {
                "backend": "dynamodb",
                "table": TABLE,
                "lease_s": args.lease_s,
                "endpoint_url": moto_url,
                "create_table": True,
            },
            "fleet": {"reconcile_interval_s": 0.5},
            # The failover pauses training for its takeover + restart; the stall rule must not read
            # that as a hang (it would restart the trainers a second time).
            "stall": {"stall_after_s": 90.0, "escalate_after_s": 180.0},
        },
        steps=1_000_000,  # the job outlasts the trials (the toy's job file says 1,000 steps)
    )
    hosts = {h: ControlHost(h, root, config, ports[h]) for h in ("a", "b")}
    trials: list[dict] = []
    launcher: Launcher | None = None
    failure = None
    try:
        await hosts["a"].start()
        await wait_until(lambda: log_events(root, "a", "leading"), 180, "a to lead")
        await hosts["b"].start()
        await wait_until(lambda: log_events(root, "b", "daemon_started"), 180, "b to stand by")
        for h in hosts.values():
            await wait_port_async("127.0.0.1", h.port, timeout=120)

        async def describe() -> list[dict]:
            return await cloud.instances(
                FLEET, states=("pending", "running", "shutting-down", "terminated", "stopping", "stopped")
            )

        def agent_conf(iid: str, addr: str, imds_url: str) -> Path:
            return configs.agent_toml(root, ep, args.nodes + 1, iid, addr, imds_url, steps=1_000_000)

        async def job_env(inst: Mapping[str, Any]) -> dict[str, str]:
            # The job from the launch template's user data, as a node booting on EC2 reads it.
            async with session.create_client("ec2", endpoint_url=moto_url, region_name="us-east-1") as ec2:
                return await template_job_env(ec2, inst)

        launcher = Launcher(root, describe, agent_conf, env={"FLEETD_EVENTS_FILE": str(events)}, job_env=job_env)
        launcher_task = asyncio.create_task(launcher.run())
        await wait_until(
            lambda: Progress.load(events).training_again_at(0.0, world=args.nodes) is not None,
            args.settle_s + 300,
            f"every one of {args.nodes} ranks training",
            every=1.0,
        )
        leader, standby = "a", "b"
        for n in range(args.trials):
            await asyncio.sleep(args.settle_s)  # past a few periodic checkpoints
            before_lead = len(log_events(root, standby, "leading"))
            before_pub = len(log_events(root, standby, "rendezvous_endpoint_published"))
            moved_before = agent_events(root, "rendezvous_endpoint_moved")
            load = os.getloadavg()[0]
            t_kill = time.time()
            killed, survivors = await hosts[leader].kill()
            await wait_until(lambda s=standby, b=before_lead: len(log_events(root, s, "leading")) > b, 120, "takeover")
            took = stamp(log_events(root, standby, "leading")[-1])
            await wait_until(
                lambda s=standby, b=before_pub: len(log_events(root, s, "rendezvous_endpoint_published")) > b,
                60,
                "the new leader's endpoint published",
            )
            published = stamp(log_events(root, standby, "rendezvous_endpoint_published")[-1])
            out = None

            def resumed(t_kill: float = t_kill) -> bool:
                nonlocal out
                out = trial_outcome(events, t_kill, args.nodes)
                return out is not None

            await wait_until(resumed, 300, "training again on the new store", every=1.0)
            await asyncio.sleep(3.0)  # a late second restart would show in the counts below
            moved = agent_events(root, "rendezvous_endpoint_moved")
            restarts = {k: v - moved_before.get(k, 0) for k, v in moved.items()}
            try:
                await assert_no_orphan_no_duplicate(cloud, FLEET, max_nodes=args.nodes)
                consistent = True
            except AssertionError as exc:
                consistent = False
                print(f"inconsistent after trial {n}: {exc}", file=sys.stderr)
            assert out is not None
            row = {
                "trial": n,
                "leader_killed": leader,
                "processes_killed": killed,
                "survivors": survivors,
                "takeover_s": round(took - t_kill, 2),
                "published_s": round(published - t_kill, 2),
                **out,
                "endpoint_restarts": restarts,
                "consistent": consistent,
                "load_1m": round(load, 1),
            }
            trials.append(row)
            print(json.dumps(row), flush=True)
            if n + 1 < args.trials:  # the killed host comes back, as the standby
                started = len(log_events(root, leader, "daemon_started"))
                await hosts[leader].start()
                await wait_until(
                    lambda h=leader, s=started: len(log_events(root, h, "daemon_started")) > s,
                    180,
                    "the killed host back as the standby",
                )
                await wait_port_async("127.0.0.1", hosts[leader].port, timeout=120)
                leader, standby = standby, leader
        launched = len(await describe())
        creates = len(proxy.calls_of("CreateFleet"))
        launcher_task.cancel()
    except Exception as exc:  # noqa: BLE001 (reported in the JSON line, the test shows it)
        failure = f"{exc!r}"
        traceback.print_exc()
        launched, creates = None, None
    finally:
        if launcher is not None:
            await launcher.close()
        for h in hosts.values():
            await h.stop()
        proxy.stop()
        broker.stop()
        server.stop()
    await asyncio.sleep(1.0)
    left = [s for s in strays(MARKER, str(os.getpid())) if not s.startswith(f"{os.getpid()} ")]
    lost = [t["steps_lost"] for t in trials]
    again = [t["training_again_s"] for t in trials]
    return {
        "bench": "leader_host_kill",
        "trials": len(trials),
        "nodes": args.nodes,
        "lease_s": args.lease_s,
        "failure": failure,
        "takeover_s": [t["takeover_s"] for t in trials],
        "published_s": [t["published_s"] for t in trials],
        "training_again_s": again,
        "training_again_median_s": statistics.median(again) if again else None,
        "longest_pause_s": [t["longest_pause_s"] for t in trials],
        "steps_lost": lost,
        "steps_lost_max": max(lost) if lost else None,
        "never_resumed": args.trials - len(trials),
        "survivors": sum(len(t["survivors"]) for t in trials),
        "endpoint_restarts_not_one": sum(1 for t in trials for v in t["endpoint_restarts"].values() if v != 1),
        "agents": max((len(t["endpoint_restarts"]) for t in trials), default=0),
        "all_consistent": bool(trials) and all(t["consistent"] for t in trials),
        "instances_launched": launched,
        "create_fleet_calls": creates,
        "stray_processes": len(left),
        "strays": left[:5],
        "load_1m": [t["load_1m"] for t in trials],
        "workdir": str(root),
        "note": "2-core box shared with other work; load_1m per trial at the kill",
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--lease-s", type=float, default=8.0)
    p.add_argument("--settle-s", type=float, default=8.0, help="training time before each kill")
    p.add_argument("--quick", action="store_true", help="one trial (the test's mode)")
    p.add_argument("--workdir", default=None)
    a = p.parse_args()
    if a.quick:
        a.trials = 1
    result = asyncio.run(main(a))
    print(json.dumps(result))
    sys.exit(0 if result["failure"] is None else 1)
