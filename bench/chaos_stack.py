"""The chaos bench's stack: the processes `fleetd demo` runs, each one killable and restartable.

    moto server (EC2, S3) ← fault proxy ← fleetd run, agents, trainers (EC2 *and* S3 go through it)
    mosquitto             ← fleetd run, agents
    fleetd rendezvous     ← torchrun on every node
    launcher: each EC2 instance → fake IMDS + fleet-agent run (→ torchrun → train_toy)

Built from the demo's parts (fleetd.demo: configs, broker, launcher, procs). The bench plays
systemd for the control-host services and the agents: a killed process is started again with the
same command line after a short delay (``Restart=on-failure``, ``RestartSec``), and a killed
agent's leftover processes are killed first (``KillMode=mixed``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.supervise.proctree import kill_tree, process_tree
from fleetd.adapters.faults import FaultProxy
from fleetd.demo import configs
from fleetd.demo.broker import start_broker
from fleetd.demo.launcher import Launcher, LocalNode, fleet_instances, template_job_env
from fleetd.demo.procs import Child
from fleetd.demo.runner import DEMO_AWS_ENV
from fleetd.localnet import free_port
from fleetd.localnet import wait_port_async as wait_port

CLI = [sys.executable, "-m", "fleetd.cli"]


@dataclass
class Stack:
    workdir: Path
    nodes: int
    budget_usd: float
    moto_url: str = ""
    proxy: FaultProxy | None = None
    services: dict[str, Child] = field(default_factory=dict)  # moto, mosquitto, rendezvous, fleetd
    argv: dict[str, list[str]] = field(default_factory=dict)
    launcher: Launcher | None = None
    events_file: Path = Path()
    fleetd_conf: Path = Path()
    session: Any = None
    _launcher_task: asyncio.Task | None = None

    @property
    def state_db(self) -> Path:
        return self.workdir / "state" / "fleetd.db"

    @property
    def aws(self) -> dict:
        """Direct to moto: what the bench itself uses to look at the cloud (never faulted)."""
        return {"endpoint_url": self.moto_url, "region_name": "us-east-1"}

    async def start(self) -> None:
        from aiobotocore.session import get_session

        os.environ.update(DEMO_AWS_ENV)
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
            os.environ.pop(var, None)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.events_file = self.workdir / "trainer-events.jsonl"
        self.session = get_session()
        moto_port = free_port()
        await self._start("moto", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)])
        await wait_port("127.0.0.1", moto_port, timeout=30)
        self.moto_url = f"http://127.0.0.1:{moto_port}"
        price_list, spot_prices = configs.demo_price_fakes()  # the demo cloud's price APIs
        self.proxy = FaultProxy(self.moto_url, price_list=price_list, spot_prices=spot_prices).start()
        broker, mqtt_url, kind = await start_broker(self.workdir)
        if kind != "mosquitto":
            raise RuntimeError("the chaos bench needs mosquitto (it restarts the broker on its port)")
        self.services["mosquitto"] = broker
        self.argv["mosquitto"] = [str(a) for a in await _argv(broker)]
        ep = configs.DemoEndpoints(
            aws_url=self.proxy.url, s3_url=self.proxy.url, mqtt_url=mqtt_url, rdzv_port=free_port()
        )
        async with self.session.create_client("s3", **self.aws) as s3:
            await s3.create_bucket(Bucket=configs.DEMO_BUCKET)
        async with self.session.create_client("ec2", **self.aws) as ec2:
            ami = (await ec2.describe_images(Owners=["amazon"]))["Images"][0]["ImageId"]
        # The job outlasts every fault (the toy's job file says 1,000 steps).
        self.fleetd_conf = configs.fleetd_toml(
            self.workdir, ep, self.nodes, self.budget_usd, 10.0, ami, steps=10_000_000
        )
        await self._start("rendezvous", [*CLI, "rendezvous", "--config", str(self.fleetd_conf)])
        # `fleetd rendezvous` imports torch first: seconds on a quiet box, over 30 s on a loaded
        # 2-core one (a chaos run failed there). A slow start is not a hang.
        await wait_port("127.0.0.1", ep.rdzv_port, timeout=120)
        await self._start("fleetd", [*CLI, "run", "--config", str(self.fleetd_conf)])

        def agent_conf(iid: str, addr: str, imds_url: str) -> Path:
            return configs.agent_toml(self.workdir, ep, self.nodes + 1, iid, addr, imds_url, steps=10_000_000)

        # terminate: a node whose dead man's switch powered it off is terminated, as AWS does a spot node.
        self.launcher = Launcher(
            self.workdir,
            self.describe,
            agent_conf,
            env={"FLEETD_EVENTS_FILE": str(self.events_file)},
            terminate=self.terminate_instance,
            job_env=self._job_env,  # the job, from the launch template's user data
        )
        self._launcher_task = asyncio.create_task(self.launcher.run(), name="launcher")

    async def _start(self, name: str, argv: list[str]) -> Child:
        child = await Child.start(name, argv, self.workdir / f"{name}.log")
        self.services[name] = child
        self.argv[name] = argv
        return child

    async def describe(self) -> list[Mapping[str, Any]]:
        async with self.session.create_client("ec2", **self.aws) as ec2:
            return await fleet_instances(ec2, configs.DEMO_FLEET)

    async def _job_env(self, inst: Mapping[str, Any]) -> dict[str, str]:
        async with self.session.create_client("ec2", **self.aws) as ec2:
            return await template_job_env(ec2, inst)

    async def terminate_instance(self, instance_id: str) -> None:
        async with self.session.create_client("ec2", **self.aws) as ec2:
            await ec2.terminate_instances(InstanceIds=[instance_id])

    # -- faults on services ---------------------------------------------------------------------
    async def kill_service(self, name: str, how: str) -> None:
        """SIGKILL the service's whole group (a crash, an OOM kill), or stop it with SIGTERM (a
        ``systemctl restart``)."""
        child = self.services[name]
        if how == "SIGKILL":
            child.signal_group(signal.SIGKILL)
            await child.proc.wait()
        else:
            await child.stop(timeout=20.0)

    async def start_service(self, name: str) -> None:
        argv = self.argv[name]
        if name == "mosquitto":
            self.services[name] = await Child.start(name, argv, self.workdir / "mosquitto.out")
        else:
            self.services[name] = await Child.start(name, argv, self.workdir / f"{name}.log")

    # -- faults on nodes ------------------------------------------------------------------------
    def live_nodes(self) -> list[LocalNode]:
        return [n for n in self.launcher.live() if n.agent.running] if self.launcher else []

    async def kill_agent(self, node: LocalNode) -> None:
        """The agent process dies; systemd (KillMode=mixed) kills what it left behind."""
        tree = process_tree(node.agent.proc.pid)
        node.agent.proc.send_signal(signal.SIGKILL)
        await node.agent.proc.wait()
        kill_tree(tree, signal.SIGKILL)

    async def start_agent(self, node: LocalNode) -> None:
        conf = self.workdir / "nodes" / node.instance_id / "agent.toml"
        node.agent = await Child.start(
            f"agent-{node.instance_id}",
            [sys.executable, "-m", "agent.cli", "run", "--config", str(conf)],
            self.workdir / "nodes" / node.instance_id / "agent.log",
            env=self.launcher.env if self.launcher else None,
        )

    def workers(self, node: LocalNode) -> list[Any]:
        """The training worker processes torchrun started on the node: the processes that said
        ``start`` in the trainer events. A command line says too little: a worker forked from the
        warm pool carries the pool's, and the ``warm_launch`` stand-ins for torchrun and for each
        worker name the entry point too (killing one of those is another fault)."""
        started = set()
        try:
            for line in self.events_file.read_text(errors="replace").splitlines():
                if '"start"' in line:
                    try:
                        started.add(int(json.loads(line)["pid"]))
                    except (ValueError, KeyError, TypeError):
                        continue  # a line cut by a SIGKILLed writer
        except FileNotFoundError:
            return []
        return [p for p in process_tree(node.agent.proc.pid)[1:] if p.pid in started]

    # -- the end --------------------------------------------------------------------------------
    async def stop(self) -> None:
        if self._launcher_task is not None:
            self._launcher_task.cancel()
            try:
                await self._launcher_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 (stopping regardless)
                pass
        if self.launcher is not None:
            await self.launcher.close()
        for name in ("fleetd", "rendezvous", "mosquitto", "moto"):
            child = self.services.get(name)
            if child is not None:
                await child.stop(timeout=15.0 if name == "fleetd" else 5.0)
        if self.proxy is not None:
            self.proxy.stop()


async def _argv(child: Child) -> list[str]:
    import psutil

    return psutil.Process(child.proc.pid).cmdline()
