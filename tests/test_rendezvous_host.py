"""`fleetd rendezvous` (the store host process), fleetd's client, and steering against torch's own
rendezvous code (DynamicRendezvousHandler over the c10d backend), without torchrun."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from fleetd.localnet import free_port, wait_port
from fleetd.rendezvous.client import RendezvousClient
from fleetd.rendezvous.errors import RendezvousUnavailable
from fleetd.rendezvous.state import encode
from fleetd.rendezvous.steer_settings import SteerSettings
from fleetd.rendezvous.steering import Steerer

RUN = "hosttest"


def start_host(tmp_path: Path, port: int) -> subprocess.Popen:
    cfg = tmp_path / "fleetd.toml"
    cfg.write_text(f'[rendezvous]\nhost = "127.0.0.1"\nport = {port}\nrun_id = "{RUN}"\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetd.cli", "rendezvous", "--config", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_port("127.0.0.1", port, 30)
    return proc


@pytest.fixture
def host(tmp_path):
    port = free_port()
    proc = start_host(tmp_path, port)
    yield port, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def handler(port: int, addr: str, last_call: int = 30, max_nodes: int = 3):
    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{port}",
        run_id=RUN,
        min_nodes=1,
        max_nodes=max_nodes,
        local_addr=addr,
        is_host="false",
        last_call_timeout=str(last_call),
        keep_alive_interval="1",
    )
    backend, store = create_backend(params)
    return create_handler(store, backend, params)


def join_in_thread(h, results: dict, name: str) -> threading.Thread:
    def run():
        started = time.monotonic()
        try:
            info = h.next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - the store went away (a test's end): kept, not raised
            results[name] = exc  # in a thread the rest of the session would see
            return
        results[name] = (info.rank, info.world_size, time.monotonic() - started)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_host_serves_until_sigterm_and_exits_cleanly(host):
    port, proc = host
    client = TCPStore("127.0.0.1", port, is_master=False, multi_tenant=True, timeout=timedelta(seconds=5))
    client.set("k", b"v")
    assert client.get("k") == b"v"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    assert b"rendezvous_host_ready" in proc.stdout.read()


def test_bad_config_is_reported_not_a_traceback(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[rendezvous]\nport = 0\n")
    out = subprocess.run(
        [sys.executable, "-m", "fleetd.cli", "rendezvous", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "rendezvous.port" in out.stderr and "Traceback" not in out.stderr


async def test_client_reads_torchs_state_and_steers_it(host):
    port, _ = host
    results: dict = {}
    a, b = handler(port, "127.0.0.2"), handler(port, "127.0.0.3")
    threads = [join_in_thread(a, results, "a"), join_in_thread(b, results, "b")]
    try:
        await _steer_torch(port, a, threads, results)
    finally:
        for h in (a, b):
            h._stop_heartbeats()


async def _steer_torch(port, a, threads, results) -> None:
    async with RendezvousClient("127.0.0.1", port, RUN) as client:
        for _ in range(100):
            snap = await client.observe()
            if snap.state is not None and len(snap.state.participants) == 2:
                break
            await asyncio.sleep(0.1)
        assert snap.state.participant_addrs == {"127.0.0.2", "127.0.0.3"} and not snap.state.complete
        # torch alone would wait out its 30 s last call; fleetd completes the round now.
        steerer = Steerer(client, SteerSettings())
        steerer.members = frozenset({"127.0.0.2", "127.0.0.3"})
        actions = await steerer.step()
        assert [type(x).__name__ for x in actions] == ["CompleteRound"]
        await asyncio.to_thread(lambda: [t.join(15) for t in threads])
        assert {k: v[:2] for k, v in results.items()} == {"a": (0, 2), "b": (1, 2)}
        assert all(v[2] < 15 for v in results.values())

        # Removing a node is seen by torch: its own state holder reads the edited value.
        await client.update(lambda s: s.without_addrs({"127.0.0.3"}))
        assert a.num_nodes_waiting() == 0
        time.sleep(1.1)  # torch caches the state for a second
        a._state_holder.sync()
        assert {n.addr for n in a._state_holder.state.participants} == {"127.0.0.2"}

        # A marker in the wait list is what makes torchrun's agents re-rendezvous.
        await client.update(lambda s: s.with_marker(datetime.now(UTC), s.round))
        time.sleep(1.1)
        assert a.num_nodes_waiting() == 1

        await steerer.close_rendezvous()
        time.sleep(1.1)
        assert a.is_closed()


async def test_compare_and_set_retries_when_a_node_writes_in_between(host):
    port, _ = host
    h = handler(port, "127.0.0.2", last_call=1, max_nodes=1)
    try:
        await asyncio.to_thread(h.next_rendezvous)  # max_nodes=1: complete at once
        other = TCPStore("127.0.0.1", port, is_master=False, multi_tenant=True, timeout=timedelta(seconds=5))
        key = f"torch.rendezvous.{RUN}"
        async with RendezvousClient("127.0.0.1", port, RUN) as client:
            calls = []

            def change(s):
                calls.append(s)
                if len(calls) == 1:  # another writer lands between our read and our write
                    current = other.get(key)
                    other.compare_set(key, current, encode(s.with_marker(datetime.now(UTC), 99)))
                return s.closed_for_good()

            written = await client.update(change)
            assert len(calls) == 2 and calls[1].has_marker, "the retry must start from the fresh value"
            assert written is not None and written.closed and written.has_marker
            assert (await client.observe()).state == written
    finally:
        h._stop_heartbeats()


async def test_host_gone_is_an_unavailable_error(host):
    port, proc = host
    client = await RendezvousClient("127.0.0.1", port, RUN, timeout_s=2).connect()
    proc.kill()
    proc.wait()
    with pytest.raises(RendezvousUnavailable):
        for _ in range(3):
            await client.observe()
