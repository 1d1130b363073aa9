"""Partition scenarios against the real stack, each node cut for real (tests/harness/netfault.py).

    moto server (EC2, S3) <- fleetd run (real reconcile loop, planner, steering, MQTT intake)
    mosquitto             <- fleetd run, every node's agent (through the node's own alias)
    fleetd rendezvous     <- every node's torchrun and trainer (through the node's own alias)
    launcher (fleetd/demo): each EC2 instance -> fake IMDS + fleet-agent run -> torchrun -> train_toy

Run it in a private network namespace (the cuts are iptables rules):

    python -m tests.harness.partitions --phases broker:60,store:3,both --out result.json
    (tests/test_partitions.py and bench/partitions.py start it with run_in_private_netns)

Phases run in order on one job (start-up is the expensive part). Each reports facts, never a
verdict: re-forms (worker starts) in its window, instances EC2 says terminated, the longest pause
between steps, how long until the survivors trained again, packets the cut dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from fleetd.demo import configs
from fleetd.demo.launcher import Launcher, template_job_env
from fleetd.demo.procs import Child
from fleetd.demo.runner import DEMO_AWS_ENV
from fleetd.localnet import free_port, wait_port_async
from fleetd.rendezvous.localcluster import Events
from tests.harness.netfault import NetFaults, control_alias

SETTLE_S = 20.0  # after a cut heals: time for a late re-form or termination to show


@dataclass
class Phase:
    kind: str  # broker | store | both
    seconds: float | None  # None: for good (both)
    target: str  # rank0 | other


def parse_phases(text: str) -> list[Phase]:
    out = []
    for item in text.split(","):
        spec, _, target = item.partition("@")
        kind, _, secs = spec.partition(":")
        default_target = "rank0" if kind == "store" else "other"
        out.append(Phase(kind, float(secs) if secs else None, target or default_target))
    return out


class HeartbeatWatch:
    """Polls torchrun's state in the store (as fleetd's steering does) and records, per node, the
    gaps between heartbeat advances: how stale a healthy node's heartbeat gets under load."""

    def __init__(self, port: int, run_id: str) -> None:
        from fleetd.rendezvous.client import RendezvousClient

        self.client = RendezvousClient("127.0.0.1", port, run_id)
        self.last: dict[str, tuple[object, float]] = {}
        self.gaps: list[tuple[str, float, float]] = []  # (addr, gap start, gap end)

    async def run(self) -> None:
        await self.client.connect()
        while True:
            snap = await self.client.observe()
            now = time.time()
            if snap.state is not None:
                for node, beat in snap.state.last_heartbeats.items():
                    prev = self.last.get(node.addr)
                    if prev is None or beat != prev[0]:
                        if prev is not None:
                            self.gaps.append((node.addr, prev[1], now))
                        self.last[node.addr] = (beat, now)
            await asyncio.sleep(0.1)

    def healthy_gaps(self, since: float, cuts: list[tuple[str, float, float]]) -> list[float]:
        """Gaps after ``since`` (training at full size), longest first, leaving out a cut node's
        own gaps during its cut and the settling after it."""
        return sorted(
            (
                round(b - a, 2)
                for addr, a, b in self.gaps
                if a >= since and not any(addr == c and a < w1 + SETTLE_S and b > w0 for c, w0, w1 in cuts)
            ),
            reverse=True,
        )


class Stack:
    def __init__(self, workdir: Path, nodes: int) -> None:
        self.workdir, self.nodes = workdir, nodes
        self.children: list[Child] = []
        self.events = Events(workdir / "trainer-events.jsonl")
        self.launcher: Launcher | None = None
        self.ec2 = None
        self.mqtt_port = free_port()
        self.rdzv_port = free_port()

    async def start(self, *, exit_stack) -> None:
        from aiobotocore.session import get_session

        os.environ.update(DEMO_AWS_ENV)
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
            os.environ.pop(var, None)
        py = sys.executable
        moto_port = free_port()
        await self._start("moto", [py, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)])
        await wait_port_async("127.0.0.1", moto_port, timeout=60)
        moto = f"http://127.0.0.1:{moto_port}"
        # The broker listens on every local address: each node reaches it through its own alias.
        from fleetd.demo.broker import find_mosquitto

        conf = self.workdir / "mosquitto.conf"
        root = "user root\n" if os.geteuid() == 0 else ""
        conf.write_text(
            f"listener {self.mqtt_port}\nallow_anonymous true\npersistence false\n"
            f"log_dest file {self.workdir / 'mosquitto.log'}\nlog_type all\n{root}"
        )
        await self._start("mosquitto", [find_mosquitto() or "mosquitto", "-c", str(conf)])
        await wait_port_async("127.0.0.1", self.mqtt_port, timeout=30)
        ep = configs.DemoEndpoints(
            aws_url=moto, s3_url=moto, mqtt_url=f"mqtt://127.0.0.1:{self.mqtt_port}", rdzv_port=self.rdzv_port
        )
        session = get_session()
        aws = {"endpoint_url": moto, "region_name": "us-east-1"}
        async with session.create_client("s3", **aws) as s3:
            await s3.create_bucket(Bucket=configs.DEMO_BUCKET)
        self.ec2 = await exit_stack.enter_async_context(session.create_client("ec2", **aws))
        ami = (await self.ec2.describe_images(Owners=["amazon"]))["Images"][0]["ImageId"]
        # Budget roomy enough that no budget rule acts during the scenario. Straggler replacement
        # off: it judges nodes by one telemetry sample of steps/s, and on this shared 2-core box
        # (load 20+ while others test) a node that just restarted, or whose rank 0 sat out a store
        # blip, reported 0.5 steps/s against a median of 6 and was replaced mid-scenario. That
        # is the scaling policy's transient (noted for its owners), not the loss rule under test.
        fleetd_conf = configs.fleetd_toml(
            self.workdir,
            ep,
            self.nodes,
            50.0,
            50.0,
            ami,
            overrides={"scaling": {"straggler_ratio": 0.01}},  # > 0: a node at <1 % of the median
            steps=10_000_000,  # the job outlasts every phase
        )
        cli = [py, "-m", "fleetd.cli"]
        await self._start("rendezvous", [*cli, "rendezvous", "--config", str(fleetd_conf)])
        await wait_port_async("127.0.0.1", self.rdzv_port, timeout=90)
        await self._start("fleetd", [*cli, "run", "--config", str(fleetd_conf)])

        def agent_conf(iid: str, addr: str, imds_url: str) -> Path:
            return configs.agent_toml(
                self.workdir,
                ep,
                self.nodes + 1,
                iid,
                addr,
                imds_url,
                steps=10_000_000,
                control_addr=control_alias(addr),
            )

        self.launcher = Launcher(
            self.workdir,
            self.describe,
            agent_conf,
            env={"FLEETD_EVENTS_FILE": str(self.events.path)},
            job_env=lambda inst: template_job_env(self.ec2, inst),  # the job, from user data
        )

    async def _start(self, name: str, argv: list[str]) -> Child:
        child = await Child.start(name, argv, self.workdir / f"{name}.log")
        self.children.append(child)
        return child

    async def describe(self) -> list[dict]:
        out = []
        pages = self.ec2.get_paginator("describe_instances").paginate(
            Filters=[{"Name": "tag:fleetd:fleet", "Values": [configs.DEMO_FLEET]}]
        )
        async for page in pages:
            for res in page["Reservations"]:
                out += res["Instances"]
        return out

    async def ec2_states(self) -> dict[str, str]:
        return {i["InstanceId"]: i["State"]["Name"] for i in await self.describe()}

    async def stop(self) -> None:
        if self.launcher is not None:
            await self.launcher.close()
        for child in reversed(self.children):
            await child.stop(timeout=10.0)

    def live_addrs(self) -> dict[str, str]:
        assert self.launcher is not None
        return {n.addr: n.instance_id for n in self.launcher.live()}

    def rank0_addr(self) -> str | None:
        starts = [e for e in self.events.of("start") if e.get("rank") == 0]
        return starts[-1]["node"] if starts else None

    def broker_timeouts(self) -> int:
        path = self.workdir / "mosquitto.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return sum("exceeded timeout" in line for line in text.splitlines())

    def log_lines(self, name: str, needle: str) -> list[dict]:
        out = []
        path = self.workdir / f"{name}.log"
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            if needle in line:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                out.append(rec)
        return out


async def wait_for(cond, timeout: float, every: float = 0.5):
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        got = await cond() if asyncio.iscoroutinefunction(cond) else cond()
        if got:
            return got
        await asyncio.sleep(every)
    return None


def steps_pause(events: Events, since: float, until: float) -> float:
    """Longest pause between consecutive completed steps (any rank) in [since, until]."""
    ts = sorted(e["t"] for e in events.of("step") if since <= e["t"] <= until)
    ts = [since, *ts, until]
    return round(max(b - a for a, b in pairwise(ts)), 2)


async def run_phase(
    stack: Stack, faults: NetFaults, phase: Phase, watch: HeartbeatWatch, windows: list[tuple[float, float]]
) -> dict:
    """Cut one node as ``phase`` says; the facts of its window (cut + SETTLE_S) in a dict."""
    live = stack.live_addrs()
    rank0 = stack.rank0_addr()
    others = sorted(a for a in live if a != rank0)
    addr = rank0 if phase.target == "rank0" and rank0 in live else others[0]
    iid = live[addr]
    ports = {"broker": [stack.mqtt_port], "store": [stack.rdzv_port], "both": [stack.mqtt_port, stack.rdzv_port]}[
        phase.kind
    ]
    world = len(live)
    before = await stack.ec2_states()
    dropped0 = faults.dropped_packets()
    tolerated0 = len(stack.log_lines("fleetd", "TolerateStale"))
    timeouts0 = stack.broker_timeouts()
    t_cut = time.time()
    out: dict = {
        "kind": phase.kind,
        "seconds": phase.seconds,
        "node": addr,
        "instance_id": iid,
        "was_rank0": addr == rank0,
        "world_before": world,
    }
    if phase.seconds is not None:
        await faults.cut_for(control_alias(addr), ports, phase.seconds)
        t_heal = time.time()
        windows.append((t_cut, t_heal))
        await asyncio.sleep(SETTLE_S)
        t_end = time.time()
        out["dropped_packets"] = faults.dropped_packets() - dropped0
        # torchrun stops a node's heartbeats for good if it dropped the node from its state.
        last = watch.last.get(addr)
        out["heartbeat_resumed"] = last is not None and last[1] > t_heal
    else:
        cut = faults.start(control_alias(addr), ports)
        survivors = set(live) - {addr}

        async def terminated() -> bool:
            return (await stack.ec2_states()).get(iid) in ("shutting-down", "terminated")

        done = await wait_for(terminated, 240)
        t_term = time.time() if done else None
        back = await wait_for(
            lambda: (
                stack.events.training_at(world - 1, t_cut, survivors)
                if len(stack.events.training_at(world - 1, t_cut, survivors)) >= world - 1
                else None
            ),
            240,
        )
        t_back = max(back.values()) if back else None
        out["dropped_packets"] = faults.dropped_packets() - dropped0
        faults.heal(cut)
        t_heal = t_end = time.time()
        windows.append((t_cut, t_heal))
        out["terminated_after_s"] = round(t_term - t_cut, 1) if t_term else None
        out["survivors_training_after_s"] = round(t_back - t_cut, 1) if t_back else None
        out["survivors"] = sorted(survivors)
    after = await stack.ec2_states()
    out["terminated"] = sorted(
        i
        for i, s in after.items()
        if s in ("shutting-down", "terminated") and before.get(i) not in ("shutting-down", "terminated")
    )
    out["reforms"] = len([e for e in stack.events.of("start") if t_cut <= e["t"] <= t_end])
    out["longest_step_pause_s"] = steps_pause(stack.events, t_cut, t_end)
    # The steering said it kept a stale member; the broker dropped a client for silence (its
    # last will): proof the cut was felt where it should be.
    out["steering_tolerated_stale"] = len(stack.log_lines("fleetd", "TolerateStale")) - tolerated0
    out["broker_timed_out_clients"] = stack.broker_timeouts() - timeouts0
    out["cut_s"] = round(t_heal - t_cut, 1)
    return out


async def scenario(workdir: Path, nodes: int, phases: list[Phase]) -> dict:
    from contextlib import AsyncExitStack

    faults = NetFaults()
    stack = Stack(workdir, nodes)
    result: dict = {"nodes": nodes, "phases": []}
    async with AsyncExitStack() as es:
        try:
            await stack.start(exit_stack=es)
            watch = HeartbeatWatch(stack.rdzv_port, "demo")
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(stack.launcher.run()), tg.create_task(watch.run())]
                t0 = time.time()
                up = await wait_for(lambda: len(stack.events.training_at(nodes, t0)) >= nodes, 420)
                result["started_after_s"] = round(time.time() - t0, 1)
                if not up:
                    result["error"] = "the job did not start training at full size"
                else:
                    await asyncio.sleep(5.0)  # a few healthy heartbeats before the first cut
                    windows: list[tuple[float, float]] = []
                    for phase in phases:
                        result["phases"].append(await run_phase(stack, faults, phase, watch, windows))
                    cuts = [(ph["node"], a, b) for ph, (a, b) in zip(result["phases"], windows, strict=True)]
                    gaps = watch.healthy_gaps(t0 + result["started_after_s"], cuts)
                    result["healthy_heartbeat_gaps"] = {
                        "n": len(gaps),
                        "max_s": gaps[0] if gaps else None,
                        "p99_s": gaps[len(gaps) // 100] if gaps else None,
                    }
                    result["healthy_step_max_gap_s"] = max(
                        (steps_pause(stack.events, a, b) for a, b in _healthy(windows, t0 + result["started_after_s"])),
                        default=None,
                    )
                for t in tasks:
                    t.cancel()
        finally:
            faults.heal_all()
            await stack.stop()
    return result


def _healthy(windows: list[tuple[float, float]], since: float) -> list[tuple[float, float]]:
    out, start = [], since
    for a, b in sorted(windows):
        if a - start > 5:
            out.append((start, a))
        start = b + SETTLE_S
    return out


async def _until_terminated(coro) -> dict:
    """SIGTERM (a test's timeout, a bench stopped by hand) cancels the scenario, whose clean-up
    heals every cut and stops every child: nothing outlives it."""
    import signal

    task = asyncio.ensure_future(coro)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        return {"error": "stopped by SIGTERM", "phases": []}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phases", default="broker:60,store:3,both")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--workdir", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fleetd-partitions-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(_until_terminated(scenario(workdir, args.nodes, parse_phases(args.phases))))
    result["workdir"] = str(workdir)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
