"""`fleet-agent run` as a real process: the last will fires when it is SIGKILLed, and SIGTERM
gives a bounded clean shutdown with the retained status saying offline."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiomqtt
import pytest

from agent.doubles.fake_imds import FakeImds
from fleetd.protocol.messages import Status

FLEET = "proctest"


def write_config(path: Path, imds_url: str, mqtt_url: str, state_dir: Path) -> None:
    path.write_text(
        f"""
[node]
fleet = "{FLEET}"
imds_url = "{imds_url}"
state_dir = "{state_dir}"
trainer_socket = "{state_dir}/trainer.sock"
poll_interval_s = 0.25
shutdown_timeout_s = 5
supervise_training = false

[mqtt]
url = "{mqtt_url}"
keepalive_s = 5

[logging]
level = "info"
"""
    )


@pytest.fixture
def workdir():
    with tempfile.TemporaryDirectory(prefix="fp-", dir="/tmp") as d:
        yield Path(d)


async def statuses(sub: aiomqtt.Client, out: list[Status]) -> None:
    async for m in sub.messages:
        out.append(Status.model_validate_json(m.payload))


async def wait_state(seen: list[Status], state: str, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while not any(s.state == state for s in seen):
        if time.monotonic() > deadline:
            raise AssertionError(f"no status {state!r} within {timeout}s; saw {[s.state for s in seen]}")
        await asyncio.sleep(0.02)
    return time.monotonic()


def start_agent(config: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "run", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
async def test_agent_process_goes_offline(mosquitto, workdir: Path, how: str) -> None:
    iid = "i-0000000000000b001" if how == "SIGKILL" else "i-0000000000000b002"
    async with FakeImds(instance_id=iid) as fake, aiomqtt.Client(mosquitto.host, mosquitto.port) as sub:
        await sub.subscribe(f"fleetd/{FLEET}/nodes/{iid}/status", qos=1)
        seen: list[Status] = []
        collector = asyncio.create_task(statuses(sub, seen))
        cfg = workdir / "agent.toml"
        write_config(cfg, fake.url, mosquitto.url, workdir)
        proc = start_agent(cfg)
        try:
            await wait_state(seen, "ready", 20)
            before = len(seen)
            sent = time.monotonic()
            proc.send_signal(getattr(signal, how))
            code = await asyncio.to_thread(proc.wait, 15)
            gone = await wait_state(seen, "offline", 10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            output = proc.stdout.read().decode() if proc.stdout else ""
            collector.cancel()

    offline = [s for s in seen[before:] if s.state == "offline"]
    assert len(offline) == 1, [s.state for s in seen]
    assert offline[0].instance_id == iid and offline[0].zone == "us-east-1a"
    assert gone - sent < 5
    if how == "SIGKILL":
        assert code == -signal.SIGKILL
        assert "agent_stopped" not in output  # the broker's last will, not a goodbye
    else:
        assert code == 0, output
        assert "agent_stopped" in output
