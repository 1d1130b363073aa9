"""The local launcher: every instance fleetd buys from the (moto) cloud becomes a local node.

A node is a fake IMDS with that instance's identity plus a real ``fleet-agent run`` process
(which runs real torchrun on CPU). Each node gets its own loopback address (127.0.0.N), so the
rendezvous sees distinct hosts. When the instance is terminated in EC2 (by fleetd, or by the
scenario playing AWS after a notice), the node's whole process tree is stopped.
"""

from __future__ import annotations

import asyncio
import base64
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from agent.doubles.fake_iid import IdentitySigner
from agent.doubles.fake_imds import FakeImds
from agent.supervise.proctree import kill_by_env, kill_tree, process_tree
from fleetd.adapters.launch_template import parse_user_data_env
from fleetd.demo.procs import Child
from fleetd.shared.logs import get_logger

log = get_logger(__name__)
FIRST_HOST_OCTET = 10  # 127.0.0.10, .11, ... (127.0.0.1 stays the control host)
# Set in each local node's agent environment (its instance id); every process of the node
# inherits it, so a stopped node's stragglers can be found (proctree.kill_by_env).
NODE_ENV = "FLEETD_DEMO_NODE"


@dataclass
class LocalNode:
    instance_id: str
    instance_type: str
    zone: str
    lifecycle: str
    addr: str
    imds: FakeImds
    agent: Child
    started_at: float
    stopped_at: float | None = None
    frozen_tree: list[psutil.Process] = field(default_factory=list)  # a vanished node's (SIGSTOPped)
    powered_off: bool = False  # its agent ran node.shutdown_command


def _epoch(value: object) -> float | None:
    return value.timestamp() if hasattr(value, "timestamp") else None


def poweroff_marker(workdir: Path, instance_id: str) -> Path:
    return workdir / "nodes" / instance_id / "poweroff"


def poweroff_command(workdir: Path, instance_id: str) -> list[str]:
    """The demo node's ``node.shutdown_command``: leave a marker the launcher turns into an EC2
    termination (a real node runs ``systemctl poweroff``)."""
    return [
        sys.executable,
        "-c",
        "import sys, pathlib, time; pathlib.Path(sys.argv[1]).write_text(str(time.time()))",
        str(poweroff_marker(workdir, instance_id)),
    ]


@dataclass
class Launcher:
    """Mirrors EC2's view of the fleet into local processes. ``describe`` returns the fleet's
    instances as dicts with InstanceId, InstanceType, Placement.AvailabilityZone, State.Name,
    InstanceLifecycle (absent for on-demand)."""

    workdir: Path
    describe: Callable[[], Awaitable[Sequence[Mapping[str, Any]]]]
    agent_config: Callable[[str, str, str], Path]  # (instance_id, addr, imds_url) -> agent.toml
    env: dict[str, str] = field(default_factory=dict)  # extra environment for every agent
    # EC2 TerminateInstances for one instance: what AWS does when a spot node powers itself off.
    terminate: Callable[[str], Awaitable[None]] | None = None
    poll_s: float = 0.5
    # Plays AWS's identity signer for every node's fake IMDS (None: documents answer 404).
    identity_signer: IdentitySigner | None = None
    # The job as the instance's launch template hands it to the agent (user data's FLEETD_JOB__*),
    # read from the cloud for each new node, as cloud-init would on EC2.
    job_env: Callable[[Mapping[str, Any]], Awaitable[dict[str, str]]] | None = None
    nodes: dict[str, LocalNode] = field(default_factory=dict)
    _next_octet: int = FIRST_HOST_OCTET

    async def run(self) -> None:
        while True:
            try:
                await self.sync(await self.describe())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the cloud being briefly unreachable is not fatal to the demo
                log.warning("launcher_sync_failed", error=str(exc))
            await asyncio.sleep(self.poll_s)

    async def sync(self, instances: Sequence[Mapping[str, Any]]) -> None:
        loop = asyncio.get_running_loop()
        await self._powered_off()
        listed = set()
        for inst in instances:
            iid, state = inst["InstanceId"], inst["State"]["Name"]
            listed.add(iid)
            node = self.nodes.get(iid)
            if state in ("pending", "running") and node is None:
                self.nodes[iid] = await self._start(inst, loop.time())
            elif state not in ("pending", "running") and node is not None and node.stopped_at is None:
                await self._stop(node, loop.time(), reason=f"EC2 state {state}")
        for node in self.live():
            if node.instance_id not in listed:  # terminated: fleet_instances no longer lists it
                await self._stop(node, loop.time(), reason="EC2 state terminated")

    async def _start(self, inst: Mapping[str, Any], now: float) -> LocalNode:
        iid = inst["InstanceId"]
        addr = f"127.0.0.{self._next_octet}"
        self._next_octet += 1
        lifecycle = "spot" if inst.get("InstanceLifecycle") == "spot" else "on-demand"
        imds = FakeImds(
            instance_id=iid,
            instance_type=inst["InstanceType"],
            zone=inst["Placement"]["AvailabilityZone"],
            lifecycle=lifecycle,
            local_ipv4=addr,
            signer=self.identity_signer,
            pending_time=_epoch(inst.get("LaunchTime")),
        )
        url = await imds.start("127.0.0.1", 0)
        conf = self.agent_config(iid, addr, url)
        agent = await Child.start(
            f"agent-{iid}",
            [sys.executable, "-m", "agent.cli", "run", "--config", str(conf)],
            self.workdir / "nodes" / iid / "agent.log",
            env={**self.env, **(await self.job_env(inst) if self.job_env is not None else {}), NODE_ENV: iid},
        )
        log.info(
            "node_started", instance_id=iid, addr=addr, pool=f"{inst['InstanceType']}@{imds.zone}", lifecycle=lifecycle
        )
        return LocalNode(iid, inst["InstanceType"], imds.zone, lifecycle, addr, imds, agent, now)

    async def _stop(self, node: LocalNode, now: float, reason: str) -> None:
        node.stopped_at = now
        if node.frozen_tree:  # vanished: nothing in it can act on a SIGTERM any more
            kill_tree(node.frozen_tree, signal.SIGKILL)
        # The instance is gone: like real hardware vanishing, no grace beyond a brief SIGTERM.
        # torchrun runs in its own session, outside the agent's process group: walk the tree
        # first, or a node whose agent needed its SIGKILL leaves a zombie torchrun training
        # on in the real rendezvous (a loaded storm test run had one train 243 steps nobody kept).
        tree = process_tree(node.agent.proc.pid)
        await node.agent.stop(timeout=3.0)
        kill_tree([p for p in tree if p.is_running()], signal.SIGKILL)
        # A worker torchrun started during the agent's stop, in a session of its own, was not in
        # the walk: a failing job restarts its worker every second (a test once found one alive).
        stragglers = await asyncio.to_thread(kill_by_env, NODE_ENV, node.instance_id)
        if stragglers:
            log.warning("node_stragglers_killed", instance_id=node.instance_id, count=stragglers)
        await node.imds.stop()
        log.info("node_stopped", instance_id=node.instance_id, reason=reason)

    async def _powered_off(self) -> None:
        """Agents whose ``node.shutdown_command`` ran (the demo's stands in for ``systemctl
        poweroff``: it writes ``poweroff`` in the node's directory) are terminated in EC2."""
        for node in self.live():
            marker = poweroff_marker(self.workdir, node.instance_id)
            if node.powered_off or not marker.exists():
                continue
            node.powered_off = True
            log.warning("node_powered_off", instance_id=node.instance_id, why=marker.read_text()[:200])
            if self.terminate is not None:
                await self.terminate(node.instance_id)

    def live(self) -> list[LocalNode]:
        return [n for n in self.nodes.values() if n.stopped_at is None]

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tg:
            for node in self.live():
                tg.create_task(self._stop(node, loop.time(), reason="demo over"))


# Every state but terminated: the launcher polls twice a second, and the terminated instances a
# demo piles up were most of each answer (moto's XML and botocore's parse: ~27 ms of CPU a call
# with 10 instances listed, 16 ms with the 4 alive). An instance missing from the answer is gone.
NOT_TERMINATED = ("pending", "running", "shutting-down", "stopping", "stopped")


async def fleet_instances(ec2: Any, fleet: str) -> list[Mapping[str, Any]]:
    """Every instance of the fleet EC2 has not terminated (the launcher boots a node for each)."""
    out: list[Mapping[str, Any]] = []
    filters = [
        {"Name": "tag:fleetd:fleet", "Values": [fleet]},
        {"Name": "instance-state-name", "Values": list(NOT_TERMINATED)},
    ]
    pages = ec2.get_paginator("describe_instances").paginate(Filters=filters)
    async for page in pages:
        for res in page["Reservations"]:
            out += res["Instances"]
    return out


async def template_job_env(ec2: Any, inst: Mapping[str, Any], fleet: str = "demo") -> dict[str, str]:
    """The job a node boots with: the FLEETD_JOB__* lines of the user data in the launch template
    fleetd launched it from (its newest version; one template per fleet), as cloud-init hands
    them to the agent on EC2. Unreadable: the agent's own config's job (logged)."""
    name = f"fleetd-{fleet}"  # fleetd.adapters.launch_template.default_template_name
    try:
        resp = await ec2.describe_launch_template_versions(LaunchTemplateName=name, Versions=["$Latest"])
        data = resp["LaunchTemplateVersions"][0]["LaunchTemplateData"].get("UserData", "")
    except Exception as exc:  # noqa: BLE001 - the demo goes on with the agent's own config
        log.error(
            "launch_template_unreadable", template=name, instance_id=inst.get("InstanceId"), error=repr(exc)[:300]
        )
        return {}
    env = parse_user_data_env(base64.b64decode(data).decode())
    # The job, and where its checkpoints are: a node in another region (a team's move) uses that
    # region's bucket, as the user data says.
    regional = ("FLEETD_AWS__REGION", "FLEETD_CHECKPOINTS__BUCKET")
    return {k: v for k, v in env.items() if k.startswith("FLEETD_JOB__") or k in regional}
