"""`fleet-agent run` under a fake systemd: READY once watching IMDS, WATCHDOG pings while the
IMDS watcher polls, STOPPING as soon as SIGTERM arrives, then a clean exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from agent.doubles.fake_imds import FakeImds
from tests.test_agent_process import write_config
from tests.test_sdnotify import notify_socket, stop  # noqa: F401  (fixture)


@pytest.mark.slow
async def test_agent_notifies_ready_watchdog_and_stopping(mosquitto, tmp_path, notify_socket):  # noqa: F811
    import asyncio

    config = tmp_path / "agent.toml"
    async with FakeImds(instance_id="i-0000000000000c001") as fake:
        write_config(config, fake.url, mosquitto.url, tmp_path / "state")
        env = {**os.environ, "NOTIFY_SOCKET": notify_socket.path, "WATCHDOG_USEC": "1000000", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", "--config", str(config)],
            env=env,
            stdout=(tmp_path / "agent.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        try:
            await asyncio.to_thread(notify_socket.collect_until, lambda m: m.get("READY") == "1", 60)
            pings = 0

            def second_ping(m):
                nonlocal pings
                pings += m.get("WATCHDOG") == "1"
                return pings >= 2

            await asyncio.to_thread(notify_socket.collect_until, second_ping, 20)
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(notify_socket.collect_until, lambda m: m.get("STOPPING") == "1", 20)
            assert await asyncio.to_thread(proc.wait, 30) == 0, (tmp_path / "agent.log").read_text()
        finally:
            stop(proc)
    kinds = notify_socket.kinds()
    assert kinds[0] == "READY" and kinds[-1] == "STOPPING" and kinds.count("WATCHDOG") >= 2
