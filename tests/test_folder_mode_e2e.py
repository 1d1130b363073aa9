"""Folder mode end to end: the PyTorch DDP tutorial's script (deploy/examples/ddp-job/train.py, no
fleetd code) under real torchrun (CPU, gloo) on 2 nodes, each supervised by the agent's folder-mode
hooks (agent/supervise/folder_hooks.py), with S3 on moto.

The script saves ``snapshot.pt`` every SAVE_EVERY epochs; the hooks upload each complete version.
A spot notice takes one node away (no signal: the script catches none): the survivor resumes from
its own last snapshot, so the epochs lost are what the script's interval loses (at most
SAVE_EVERY, counting the epoch in progress). A replacement with an empty disk gets the newest
durable version restored into its folder before torchrun starts and resumes from it.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agent.supervise.folder_hooks import FolderHooks, FolderSettings
from fleetd.protocol.messages import Notice
from fleetd.rendezvous.localcluster import LocalCluster
from fleetd.shared.settings import AwsConfig, CheckpointConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
BUCKET = "folder-e2e"
SAVE_EVERY = 4
SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "examples" / "ddp-job" / "train.py"
EPOCH = re.compile(r"^\[GPU\d+\] Epoch (\d+) ", re.M)
RESUMED = re.compile(r"Resuming training from snapshot at Epoch (\d+)")


class Node:
    def __init__(self, cluster: LocalCluster, addr: str, aws_client_kwargs: dict) -> None:
        self.addr = addr
        self.dir = cluster.workdir / "nodes" / addr
        self.folder = self.dir / "folder"
        self.log = self.dir / "torchrun.log"
        self.events: list = []
        spec = replace(
            cluster.spec(addr),
            entrypoint=str(SCRIPT),
            module=False,
            args=("100000", str(SAVE_EVERY), "--snapshot_path", str(self.folder / "snapshot.pt"), "--sleep", "0.03"),
        )

        async def publish(event: object) -> None:
            self.events.append(event)

        async def set_state(state: str) -> None:
            return None

        self.hooks = FolderHooks(
            spec=spec,
            instance_id=addr,
            publish_event=publish,
            set_state=set_state,
            checkpoints=CheckpointConfig(bucket=BUCKET, prefix="checkpoints", local_dir=self.dir / "agent"),
            aws=AwsConfig(region=aws_client_kwargs["region_name"], endpoint_url=aws_client_kwargs["endpoint_url"]),
            log_path=self.log,
            folder=FolderSettings(self.folder, "none", 1.0),
            client_config=aws_client_kwargs["config"],
        )
        self.task: asyncio.Task | None = None

    async def start(self, cluster: LocalCluster) -> None:
        self.task = asyncio.create_task(self.hooks.run())
        while self.hooks.torchrun is None:
            if self.task.done():
                self.task.result()
            await asyncio.sleep(0.05)
        cluster.nodes[self.addr] = self.hooks.torchrun  # close() ends it whatever happens

    def text(self, offset: int = 0) -> str:
        return self.log.read_bytes()[offset:].decode(errors="replace") if self.log.exists() else ""

    def uploaded(self) -> list[int]:
        return [e.step for e in self.events if type(e).__name__ == "CheckpointUploaded"]


async def until(cond, timeout: float, what: str, cluster: LocalCluster):  # noqa: ANN001, ANN201
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        await asyncio.sleep(0.2)
    print(cluster.logs())
    raise TimeoutError(what)


async def test_ddp_tutorial_script_in_folder_mode(tmp_path, aws_client_kwargs):
    from agent.checkpoint_store import CheckpointStore

    cluster = LocalCluster(
        tmp_path / "job",
        run_id="folder",
        min_nodes=1,
        max_nodes=3,
        s3_bucket=BUCKET,
        s3_endpoint=aws_client_kwargs["endpoint_url"],
    )
    a, b, c = (Node(cluster, addr, aws_client_kwargs) for addr in ("127.0.0.2", "127.0.0.3", "127.0.0.4"))
    cfg = CheckpointConfig(bucket=BUCKET, prefix="checkpoints", local_dir=tmp_path / "check")
    aws = AwsConfig(region=aws_client_kwargs["region_name"], endpoint_url=aws_client_kwargs["endpoint_url"])
    try:
        async with CheckpointStore.connect(cfg, aws, job="folder", client_config=aws_client_kwargs["config"]) as store:
            await store.ensure_bucket()
            await asyncio.to_thread(cluster.start_host)
            cluster.start_steering()
            await a.start(cluster)
            await b.start(cluster)
            # Two snapshots saved and uploaded: the job is well under way.
            await until(lambda: len(a.uploaded()) >= 2, 240, "two versions uploaded", cluster)

            # -- a notice on b: no signal (the tutorial catches none); b leaves, a goes on alone
            offset = len(a.text().encode())
            t_notice = time.monotonic()
            await b.hooks.on_notice(
                Notice(instance_id=b.addr, action="terminate", action_time=datetime.now(UTC) + timedelta(seconds=120))
            )
            t_left = time.monotonic()
            resumed = await until(lambda: RESUMED.findall(a.text(offset)), 120, "the survivor resumed", cluster)
            resumed_at = int(resumed[0])
            # The epoch the survivor was in when its workers restarted (the log up to "Loading snapshot").
            full = a.text()
            before_restart = full[: full.index("Loading snapshot", offset)]
            last_epoch = max(map(int, EPOCH.findall(before_restart)))
            lost = last_epoch - resumed_at
            assert resumed_at % SAVE_EVERY == 0 and 0 <= lost <= SAVE_EVERY, (resumed_at, last_epoch)
            # Epochs 0..last_epoch-1 were complete; the script goes on from resumed_at (it re-runs
            # the epoch it saved after, as the tutorial does): lost = last_epoch - resumed_at
            # completed epochs plus the one in progress, at most save_every completed ones.
            print(
                f"folder mode, notice: node left {t_left - t_notice:.1f} s after the notice; survivor was in "
                f"epoch {last_epoch}, resumed at epoch {resumed_at}: {lost} completed epoch(s) lost plus "
                f"the one in progress (bound: save_every = {SAVE_EVERY} epochs)"
            )
            await b.task

            # -- a replacement with an empty disk: the newest durable version is restored first
            await until(
                lambda: EPOCH.findall(a.text(offset + 1)) and len(a.uploaded()) >= 3,
                120,
                "the survivor saved again",
                cluster,
            )
            durable_before = max(await store.complete_steps())
            offset = len(a.text().encode())
            await c.start(cluster)
            assert (c.folder / "snapshot.pt").is_file(), "restored before torchrun started"
            assert c.hooks.sync is not None and c.hooks.sync.last_version >= durable_before
            c_resumed = await until(lambda: RESUMED.findall(c.text()), 180, "the replacement resumed", cluster)
            a_resumed = await until(lambda: RESUMED.findall(a.text(offset)), 60, "the survivor re-formed", cluster)
            print(
                f"folder mode, replacement: restored version {c.hooks.sync.last_version}, resumed at epoch "
                f"{c_resumed[0]}; survivor resumed at epoch {a_resumed[0]}"
            )
            assert int(c_resumed[0]) >= resumed_at
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        for node in (a, b, c):
            if node.task is not None and not node.task.done():
                node.task.cancel()
        await asyncio.to_thread(cluster.close)


SAVE_ON_SIGNAL = """
import os, signal, sys, time
import torch, torch.distributed as dist

path = sys.argv[1]
dist.init_process_group("gloo")
step = torch.load(path)["step"] if os.path.exists(path) else 0
print("start", step, flush=True)
asked = False


def on_usr1(signum, frame):
    global asked
    asked = True


signal.signal(signal.SIGUSR1, on_usr1)
while True:
    step += 1
    time.sleep(0.05)
    print("step", step, flush=True)
    if asked:  # saves only when told, under a temporary name renamed into place
        torch.save({"step": step}, path + ".tmp")
        os.replace(path + ".tmp", path)
        print("saved", step, flush=True)
        asked = False
"""


async def test_notice_signal_gets_the_scripts_save_uploaded_before_the_node_leaves(tmp_path, aws_client_kwargs):
    from agent.checkpoint_store import CheckpointStore

    script = tmp_path / "save_on_signal.py"
    script.write_text(SAVE_ON_SIGNAL)
    cluster = LocalCluster(
        tmp_path / "job",
        run_id="signal",
        min_nodes=1,
        max_nodes=2,
        s3_bucket=BUCKET,
        s3_endpoint=aws_client_kwargs["endpoint_url"],
    )
    node = Node(cluster, "127.0.0.2", aws_client_kwargs)
    node.hooks.spec = replace(
        node.hooks.spec, entrypoint=str(script), args=(str(node.folder / "state.pt"),), job="signal"
    )
    node.hooks.folder = FolderSettings(node.folder, "SIGUSR1", 0.5)
    cfg = CheckpointConfig(bucket=BUCKET, prefix="checkpoints", local_dir=tmp_path / "check")
    aws = AwsConfig(region=aws_client_kwargs["region_name"], endpoint_url=aws_client_kwargs["endpoint_url"])
    try:
        async with CheckpointStore.connect(cfg, aws, job="signal", client_config=aws_client_kwargs["config"]) as store:
            await store.ensure_bucket()
            await asyncio.to_thread(cluster.start_host)
            cluster.start_steering()
            await node.start(cluster)
            await until(lambda: "step 20" in node.text(), 180, "training", cluster)
            assert not await store.complete_steps(), "the script saves only when told"
            await node.hooks.on_notice(
                Notice(
                    instance_id=node.addr, action="terminate", action_time=datetime.now(UTC) + timedelta(seconds=120)
                )
            )
            saved = [int(s) for s in re.findall(r"^saved (\d+)$", node.text(), re.M)]
            assert len(saved) == 1, node.text()[-500:]
            assert await store.complete_steps() == [1], "the save the signal asked for is durable"
            restored = await store.restore_latest(tmp_path / "restored")
            assert torch_load_step(restored.directory / "state.pt") == saved[0]
            last = max(int(s) for s in re.findall(r"^step (\d+)$", node.text(), re.M))
            print(
                f"folder mode with SIGUSR1: saved step {saved[0]} (durable before the leave); "
                f"the script had reached step {last} when its tree was stopped"
            )
            await node.task
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        if node.task is not None and not node.task.done():
            node.task.cancel()
        await asyncio.to_thread(cluster.close)


def torch_load_step(path: Path) -> int:
    import torch

    return int(torch.load(path)["step"])
