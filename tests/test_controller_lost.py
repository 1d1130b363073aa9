"""The control host gone (issue 14, item 4): a real `fleet-agent run` process training with real
torchrun loses both its MQTT broker (mosquitto stopped) and its rendezvous store (`fleetd
rendezvous` SIGKILLed). Past ``node.controller_lost_after_s`` it makes its newest checkpoint
durable in S3 (moto) and runs ``node.shutdown_command`` (here: a marker file, what the demo's
launcher turns into an EC2 termination). A controller that comes back resumes the job from S3:
a fresh node with an empty disk starts from that step.
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

from agent.checkpoint_store import CheckpointStore
from agent.doubles.fake_imds import FakeImds
from fleetd.demo.configs import trainer_socket_for
from fleetd.rendezvous.localcluster import LocalCluster
from fleetd.shared.settings import AwsConfig, CheckpointConfig
from tests.harness.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
BUCKET = "deadman"
JOB = "dm"


def agent_config(
    path: Path, *, imds: str, mqtt: str, rdzv_port: int, s3: str, node_dir: Path, marker: Path, events: Path
) -> None:
    shutdown = [sys.executable, "-c", "import sys, pathlib; pathlib.Path(sys.argv[1]).write_text('off')", str(marker)]
    path.write_text(f"""
[node]
fleet = "dm"
imds_url = "{imds}"
node_addr = "127.0.0.2"
state_dir = "{node_dir}"
trainer_socket = "{trainer_socket_for(node_dir)}"
min_nodes = 1
max_nodes = 2
shutdown_timeout_s = 20
controller_lost_after_s = 8.0
shutdown_command = {json.dumps(shutdown)}

[aws]
region = "us-east-1"
endpoint_url = "{s3}"

[mqtt]
url = "{mqtt}"
keepalive_s = 5

[rendezvous]
host = "127.0.0.1"
port = {rdzv_port}
run_id = "{JOB}"

[checkpoints]
bucket = "{BUCKET}"
prefix = "checkpoints"
interval_steps = 1000000
local_dir = "{node_dir}/checkpoints"

[job]
name = "{JOB}"
entrypoint = "agent.examples.toy_job.train_toy"
args = ["--steps", "1000000", "--step-sleep", "0.05"]

[logging]
json = true
""")


def store_for(aws_client_kwargs: dict, local_dir: Path):
    cfg = CheckpointConfig(bucket=BUCKET, prefix="checkpoints", local_dir=local_dir)
    aws = AwsConfig(region=aws_client_kwargs["region_name"], endpoint_url=aws_client_kwargs["endpoint_url"])
    return CheckpointStore.connect(cfg, aws, job=JOB, client_config=aws_client_kwargs["config"])


def last_step(events: Path) -> int:
    steps = (
        [json.loads(x).get("step", 0) for x in events.read_text().splitlines() if '"ev": "step"' in x]
        if events.exists()
        else []
    )
    return max(steps, default=0)


async def test_agent_cut_from_broker_and_store_checkpoints_to_s3_and_powers_off(
    tmp_path, mosquitto_factory, aws_client_kwargs, monkeypatch
):
    broker = mosquitto_factory().start()
    cluster = LocalCluster(tmp_path / "control", run_id=JOB, port=free_port())
    node_dir, marker, events = tmp_path / "node", tmp_path / "poweroff", tmp_path / "events.jsonl"
    node_dir.mkdir()
    async with store_for(aws_client_kwargs, tmp_path / "scratch") as store:
        await store.ensure_bucket()
    with cluster:
        await asyncio.to_thread(cluster.start_host)
        async with FakeImds(instance_id="i-0000000000000d001") as imds:
            conf = tmp_path / "agent.toml"
            agent_config(
                conf,
                imds=imds.url,
                mqtt=broker.url,
                rdzv_port=cluster.port,
                s3=aws_client_kwargs["endpoint_url"],
                node_dir=node_dir,
                marker=marker,
                events=events,
            )
            log = open(tmp_path / "agent.log", "w")
            agent = subprocess.Popen(
                [sys.executable, "-m", "agent.cli", "run", "--config", str(conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "FLEETD_EVENTS_FILE": str(events)},
            )
            try:
                deadline = time.monotonic() + 180
                while last_step(events) < 20:
                    assert agent.poll() is None and time.monotonic() < deadline, (tmp_path / "agent.log").read_text()
                    await asyncio.sleep(0.5)

                # -- the control host goes away: broker and store both
                broker.stop()
                cluster.rdzv_host_proc.send_signal(signal.SIGKILL)
                cluster.rdzv_host_proc.wait()
                t_cut = time.time()
                code = await asyncio.to_thread(agent.wait, 120)
                t_off = time.time()
            finally:
                if agent.poll() is None:
                    agent.kill()
                    agent.wait()
                log.close()
    out = (tmp_path / "agent.log").read_text()
    assert code == 0, out[-3000:]
    assert marker.read_text() == "off", "the shutdown command did not run"
    assert t_off - t_cut > 8.0, "powered off before the bound"
    trained = last_step(events)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    durable = [x for x in lines if x.get("event") == "controller_lost_checkpoint_durable"]
    assert durable and durable[0]["complete"], out[-3000:]
    step = durable[0]["step"]
    assert step >= trained - 1, (step, trained)  # the workers saved the step they completed
    assert [x for x in lines if x.get("event") == "powering_off"]

    # -- S3 holds it, complete; a controller that comes back resumes a fresh node from it
    async with store_for(aws_client_kwargs, tmp_path / "restore") as store:
        restored = await store.restore_latest(tmp_path / "restore" / "ckpt")
    assert restored is not None and restored.step == step
    fresh = LocalCluster(
        tmp_path / "back",
        run_id=JOB,
        s3_bucket=BUCKET,
        s3_endpoint=aws_client_kwargs["endpoint_url"],
        s3_prefix="checkpoints",
        train_args=("--steps", "1000000", "--step-sleep", "0.05"),
    )
    with fresh:
        await asyncio.to_thread(fresh.start_host)
        t0 = time.time()
        fresh.add_node("127.0.0.3")
        await asyncio.to_thread(fresh.events.wait_training, 1, t0, 180)
        assert {e["from_step"] for e in fresh.events.of("resumed")} == {step}
