"""sd_notify over a fake NOTIFY_SOCKET: the test binds the unix datagram socket systemd would own."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from itertools import pairwise
from pathlib import Path

import pytest

from fleetd.shared.sdnotify import Heartbeat, Notifier, watchdog

# A daemon entrypoint shaped like fleetd's and the agent's: notifier from the environment, a main
# loop that beats a heartbeat, the watchdog task in the same TaskGroup, READY once serving,
# STOPPING as soon as SIGTERM arrives, then a bounded clean exit. STALL_AFTER_S makes the loop hang
# (stop beating) to show that pings stop while the loop is unhealthy.
DAEMON = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from fleetd.shared.sdnotify import Heartbeat, Notifier, watchdog

    async def main() -> int:
        notifier = Notifier.from_environment()
        assert "NOTIFY_SOCKET" not in os.environ, "children must not inherit NOTIFY_SOCKET"
        heartbeat = Heartbeat(max_silence_s=float(os.environ.get("MAX_SILENCE_S", "1.0")))
        stall_after = float(os.environ.get("STALL_AFTER_S", "inf"))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)

        async def main_loop() -> None:
            started = loop.time()
            while not stop.is_set():
                if loop.time() - started < stall_after:
                    heartbeat.beat()
                await asyncio.sleep(0.05)

        async with asyncio.TaskGroup() as tg:
            dog = tg.create_task(watchdog(notifier, heartbeat))
            work = tg.create_task(main_loop())
            notifier.ready("serving")
            await stop.wait()
            notifier.stopping("shutting down")
            await work
            dog.cancel()
        return 0

    sys.exit(asyncio.run(main()))
    """
)


class NotifySocket:
    """The systemd side: a bound unix datagram socket collecting notify messages."""

    def __init__(self, path: Path | str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.path = str(path)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, dict[str, str]]] = []

    def collect_until(self, predicate, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            self.messages.append((time.monotonic(), fields))
            if predicate(fields):
                return
        raise AssertionError(f"timed out; received {[m for _, m in self.messages]}")

    def kinds(self) -> list[str]:
        out = []
        for _, m in self.messages:
            out += [k for k in ("READY", "WATCHDOG", "STOPPING") if m.get(k) == "1"]
        return out

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify_socket():
    # A short directory of its own: unix socket paths are limited to 108 bytes, tmp_path can exceed it.
    directory = tempfile.mkdtemp(prefix="sdn-")
    s = NotifySocket(os.path.join(directory, "notify.sock"))
    yield s
    s.close()
    shutil.rmtree(directory, ignore_errors=True)


def start_daemon(tmp_path: Path, notify: str, **env: str) -> subprocess.Popen:
    script = tmp_path / "daemon.py"
    script.write_text(DAEMON)
    full_env = {**os.environ, "NOTIFY_SOCKET": notify, "WATCHDOG_USEC": "400000", **env}
    full_env.pop("WATCHDOG_PID", None)
    return subprocess.Popen([sys.executable, str(script)], env=full_env, cwd=Path(__file__).parent.parent)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def test_daemon_sends_ready_then_watchdog_pings_then_stopping_on_sigterm(tmp_path, notify_socket):
    proc = start_daemon(tmp_path, notify_socket.path)
    try:
        notify_socket.collect_until(lambda m: m.get("READY") == "1", timeout=30)
        assert notify_socket.messages[-1][1]["STATUS"] == "serving"
        pings = 0

        def third_ping(m: dict[str, str]) -> bool:
            nonlocal pings
            pings += m.get("WATCHDOG") == "1"
            return pings >= 3

        notify_socket.collect_until(third_ping, timeout=15)
        proc.send_signal(signal.SIGTERM)
        notify_socket.collect_until(lambda m: m.get("STOPPING") == "1", timeout=15)
        assert proc.wait(15) == 0
    finally:
        stop(proc)
    kinds = notify_socket.kinds()
    assert kinds[0] == "READY" and kinds[-1] == "STOPPING"
    assert kinds[1:-1] == ["WATCHDOG"] * len(kinds[1:-1]) and len(kinds) - 2 >= 3
    # WatchdogSec=0.4 s -> pings every ~0.2 s (half). Generous bounds: the box is shared.
    ping_times = [t for t, m in notify_socket.messages if m.get("WATCHDOG") == "1"]
    gaps = [b - a for a, b in pairwise(ping_times)]
    assert all(0.1 < g < 2.0 for g in gaps), gaps


def test_pings_stop_while_the_main_loop_is_stuck(tmp_path, notify_socket):
    proc = start_daemon(tmp_path, notify_socket.path, STALL_AFTER_S="0.5", MAX_SILENCE_S="0.5")
    try:
        notify_socket.collect_until(lambda m: m.get("READY") == "1", timeout=30)
        ready_at = notify_socket.messages[-1][0]
        # Loop stalls 0.5 s after start and is unhealthy 0.5 s later: pings must dry up by ~1 s.
        with pytest.raises(AssertionError):
            notify_socket.collect_until(lambda m: False, timeout=3.0)
        proc.send_signal(signal.SIGTERM)
        notify_socket.collect_until(lambda m: m.get("STOPPING") == "1", timeout=15)
        assert proc.wait(15) == 0
    finally:
        stop(proc)
    pings = [t - ready_at for t, m in notify_socket.messages if m.get("WATCHDOG") == "1"]
    assert pings, "the healthy start should have produced pings"
    assert max(pings) < 2.0, pings  # nothing in the last ~1.5 s of the 3 s window
    stopping_at = notify_socket.messages[-1][0] - ready_at
    assert stopping_at > 3.0


def test_abstract_socket_name():
    name = f"@fleetd-test-{os.getpid()}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(b"\0" + name[1:].encode())
    server.settimeout(5)
    try:
        n = Notifier(name)
        assert n.ready("up") and n.status("two\nlines")
        assert server.recv(100) == b"READY=1\nSTATUS=up"
        assert server.recv(100) == b"STATUS=two lines"
        n.close()
    finally:
        server.close()


def test_outside_systemd_everything_is_a_noop():
    env: dict[str, str] = {}
    n = Notifier.from_environment(env)
    assert not n.enabled and n.watchdog_interval_s is None
    assert n.ready() is False and n.stopping() is False and n.watchdog_ping() is False


def test_environment_is_unset_for_children_and_watchdog_pid_respected():
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}
    n = Notifier.from_environment(env)
    assert env == {} and n.watchdog_interval_s == 15.0
    other = Notifier.from_environment({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval_s is None  # meant for another process
    bad = Notifier.from_environment({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "soon"})
    assert bad.enabled and bad.watchdog_interval_s is None


def test_send_to_a_missing_socket_does_not_raise(tmp_path):
    n = Notifier(str(tmp_path / "nobody-listens"))
    assert n.ready() is False


def test_heartbeat_freshness_with_injected_clock():
    now = [100.0]
    hb = Heartbeat(max_silence_s=5, clock=lambda: now[0])
    assert hb.healthy()
    now[0] = 105.0
    assert hb.healthy()
    now[0] = 105.1
    assert not hb.healthy()
    hb.beat()
    assert hb.healthy() and hb.silence_s == 0
    with pytest.raises(ValueError):
        Heartbeat(max_silence_s=0)


def test_heartbeat_following_a_progress_counter():
    now, polls = [0.0], [0]
    hb = Heartbeat.following(lambda: polls[0], max_silence_s=5, clock=lambda: now[0])
    now[0] = 4.0
    polls[0] += 1  # the loop made progress
    assert hb.healthy()
    now[0] = 8.0  # no progress since the last look at 4.0, but within 5 s of it
    assert hb.healthy()
    now[0] = 9.5
    assert not hb.healthy()
    polls[0] += 1
    assert hb.healthy()


async def test_watchdog_returns_at_once_without_watchdog_usec():
    await asyncio.wait_for(watchdog(Notifier("/run/x"), Heartbeat(1.0)), timeout=1)
    await asyncio.wait_for(watchdog(Notifier(None, 1_000_000), Heartbeat(1.0)), timeout=1)


# ------------------------------------------------------------------ the real daemon
def _fleetd_config(cloud, tmp_path: Path) -> Path:
    from tests.reconcile_support import TYPES, ZONES

    path = tmp_path / "fleetd.toml"
    subnets = ", ".join(f'"{cloud.subnets[z]}"' for z in ZONES)
    types = ", ".join(f'"{t}"' for t in TYPES)
    zones = ", ".join(f'"{z}"' for z in ZONES)
    path.write_text(
        f'[aws]\nendpoint_url = "{cloud.proxy.url}"\n'
        f'[fleet]\nname = "t"\nmin_nodes = 1\nmax_nodes = 1\nstate_dir = "{tmp_path / "state"}"\n'
        "reconcile_interval_s = 0.5\n"
        f'[capacity]\ninstance_types = [{types}]\nzones = [{zones}]\nami_id = "{cloud.ami}"\n'
        f"subnet_ids = [{subnets}]\n"
        "[logging]\njson = true\n"
    )
    return path


@pytest.mark.slow
def test_fleetd_run_notifies_ready_watchdog_and_stopping(cloud, tmp_path, notify_socket):
    """`fleetd run` itself (fleetd/daemon.py) against moto, as systemd would start it."""
    config = _fleetd_config(cloud, tmp_path)
    env = {**os.environ, "NOTIFY_SOCKET": notify_socket.path, "WATCHDOG_USEC": "1000000"}
    env.pop("WATCHDOG_PID", None)
    log = (tmp_path / "fleetd.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetd.cli", "run", "--config", str(config)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        notify_socket.collect_until(lambda m: m.get("READY") == "1", timeout=60)
        pings = 0

        def second_ping(m: dict[str, str]) -> bool:
            nonlocal pings
            pings += m.get("WATCHDOG") == "1"
            return pings >= 2

        notify_socket.collect_until(second_ping, timeout=20)
        proc.send_signal(signal.SIGTERM)
        notify_socket.collect_until(lambda m: m.get("STOPPING") == "1", timeout=20)
        assert proc.wait(30) == 0, (tmp_path / "fleetd.log").read_text()
    finally:
        stop(proc)
        log.close()
    kinds = notify_socket.kinds()
    assert kinds[0] == "READY" and kinds[-1] == "STOPPING" and kinds.count("WATCHDOG") >= 2


@pytest.mark.slow
def test_fleetd_rendezvous_notifies_ready_watchdog_and_stopping(tmp_path, notify_socket):
    """`fleetd rendezvous` (fleetd/rendezvous/host.py): pings follow its store self-check."""
    from tests.harness.ports import free_port

    config = tmp_path / "fleetd.toml"
    config.write_text(f'[rendezvous]\nhost = "127.0.0.1"\nport = {free_port()}\n[logging]\njson = true\n')
    env = {**os.environ, "NOTIFY_SOCKET": notify_socket.path, "WATCHDOG_USEC": "20000000"}
    log = (tmp_path / "rendezvous.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetd.cli", "rendezvous", "--config", str(config)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        notify_socket.collect_until(lambda m: m.get("READY") == "1", timeout=60)
        notify_socket.collect_until(lambda m: m.get("WATCHDOG") == "1", timeout=30)
        proc.send_signal(signal.SIGTERM)
        notify_socket.collect_until(lambda m: m.get("STOPPING") == "1", timeout=30)
        assert proc.wait(30) == 0, (tmp_path / "rendezvous.log").read_text()
    finally:
        stop(proc)
        log.close()
    kinds = notify_socket.kinds()
    assert kinds[0] == "READY" and kinds[-1] == "STOPPING" and "WATCHDOG" in kinds
