"""fleetd's torch-free store client against torch's own TCPStore, server and client, both server
backends; what it does when the peer is down, not a store, or goes away; and that the node agent's
store traffic no longer imports torch."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # torch re-exports it without `as`/__all__

from fleetd.protocol import rendezvous_keys as keys
from fleetd.shared.c10d_store import C10dStoreClient, StoreWireError


@pytest.fixture(params=[True, False], ids=["libuv", "classic"])
def server(request: pytest.FixtureRequest) -> Iterator[object]:
    store = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=request.param, timeout=timedelta(seconds=5))
    yield store
    del store


def _torch_client(port: int) -> object:
    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))


def test_every_query_interoperates_with_torchs_client(server: object) -> None:
    port = server.port  # type: ignore[attr-defined]
    theirs = _torch_client(port)
    ours = C10dStoreClient("127.0.0.1", port, timeout_s=2).connect()

    ours.set("fleetd.a", b"hello")
    assert theirs.get("fleetd.a") == b"hello"  # type: ignore[attr-defined]
    theirs.set("fleetd.b", b"\x00\xffbinary")  # type: ignore[attr-defined]
    assert ours.get("fleetd.b") == b"\x00\xffbinary"
    assert ours.check(["fleetd.a", "fleetd.b"]) and not ours.check(["fleetd.a", "fleetd.missing"])

    assert ours.add("n", 3) == 3
    assert theirs.add("n", 2) == 5  # type: ignore[attr-defined]
    assert ours.add("n", 0) == 5

    # compare_set: a missing key with an empty expectation is created; a wrong one changes nothing.
    assert ours.compare_set("cas", b"", b"v1") == b"v1"
    assert ours.compare_set("cas", b"stale", b"v2") == b"v1"
    assert theirs.compare_set("cas", b"v1", b"v3") == b"v3"  # type: ignore[attr-defined]
    assert ours.compare_set("cas", b"v3", b"v4") == b"v4"
    assert theirs.get("cas") == b"v4"  # type: ignore[attr-defined]

    theirs.delete_key("fleetd.b")  # type: ignore[attr-defined]
    assert not ours.check(["fleetd.b"])

    big = bytes(range(256)) * 4096  # 1 MiB: a rendezvous state with many nodes stays far below
    ours.set("big", big)
    assert theirs.get("big") == big and ours.get("big") == big  # type: ignore[attr-defined]


def test_a_refused_connection_is_retried_until_the_timeout_then_an_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        began = time.monotonic()
        with pytest.raises(StoreWireError, match="unreachable"):
            C10dStoreClient("127.0.0.1", port, timeout_s=0.6).connect()
    assert 0.2 <= time.monotonic() - began < 3


def test_a_store_that_starts_late_is_reached_within_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    refused = threading.Event()
    connect = socket.create_connection

    def noting_refusals(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        try:
            return connect(*args, **kwargs)
        except ConnectionRefusedError:
            refused.set()
            raise

    monkeypatch.setattr(socket, "create_connection", noting_refusals)
    started: list[object] = []

    def start_once_refused() -> None:  # the store comes up only after the client was turned away
        assert refused.wait(10)
        started.append(TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5)))

    t = threading.Thread(target=start_once_refused)
    t.start()
    try:
        client = C10dStoreClient("127.0.0.1", port, timeout_s=10).connect()
        assert client.add("k", 1) == 1
    finally:
        t.join()
    assert refused.is_set()


def _fake_peer(answer: bytes) -> tuple[socket.socket, int]:
    """A TCP server that is not a store: it answers every connection with ``answer`` and waits."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    held: list[socket.socket] = []  # kept open: a peer that answers and then says nothing more

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.recv(64)
            conn.sendall(answer)
            held.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


@pytest.mark.parametrize("answer", [b"HTTP/1.1 400 Bad Request\r\n\r\n", b""], ids=["http", "silent"])
def test_a_peer_that_is_not_a_store_is_an_error_not_a_hang(answer: bytes) -> None:
    srv, port = _fake_peer(answer)
    try:
        began = time.monotonic()
        with pytest.raises(StoreWireError):
            C10dStoreClient("127.0.0.1", port, timeout_s=0.5).connect()
        assert time.monotonic() - began < 3
    finally:
        srv.close()


def test_a_store_gone_mid_connection_fails_fast_and_stays_closed(server: object) -> None:
    client = C10dStoreClient("127.0.0.1", server.port, timeout_s=2).connect()  # type: ignore[attr-defined]
    assert client.add("k", 1) == 1
    client._sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]  # the connection cut under it
    with pytest.raises(StoreWireError):
        client.add("k", 1)
    with pytest.raises(StoreWireError, match="not connected"):
        client.check(["k"])


def test_the_agents_store_traffic_does_not_import_torch(server: object) -> None:
    """The agent's process reaches the store (probe, checkpoint request, salvage key) and never
    imports torch: its ~1.6 CPU-s and ~200 MB stay in the job's processes."""
    port = server.port  # type: ignore[attr-defined]
    server.set("fleetd.host.incarnation", b"life-1")  # type: ignore[attr-defined]
    code = f"""
import sys
import agent.cli, agent.main
from agent.supervise.store_watch import probe
from agent.trainer.store_link import StoreLink
assert probe("127.0.0.1", {port}, "job").incarnation == "life-1"
link = StoreLink("127.0.0.1", {port}, "job").connect()
assert link.request_checkpoint("notice", leaving=("10.0.0.9",)) == 1
assert link.latest_request_seq() == 1 and link.salvaged() is None
print(sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
    # What the agent wrote, torch's client reads as the controller would.
    theirs = _torch_client(port)
    assert theirs.add(keys.request_seq_key("job"), 0) == 1  # type: ignore[attr-defined]
    req = keys.parse_value(keys.CheckpointRequest, theirs.get(keys.request_key("job", 1)))  # type: ignore[attr-defined]
    assert req.reason == "notice" and req.leaving == ("10.0.0.9",)
