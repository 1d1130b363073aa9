"""The rendezvous round and size that /metrics and `fleetd status` show, read from a real store."""

from __future__ import annotations

import asyncio
import contextlib

from fleetd.protocol import rendezvous_keys as keys
from fleetd.publish import RendezvousWatcher
from fleetd.rendezvous import state as codec
from fleetd.rendezvous.host import open_server
from tests.harness.ports import free_port


async def wait_until(predicate, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_watcher_follows_the_round_and_counts_nodes_not_markers():
    port = free_port()
    watcher = RendezvousWatcher("127.0.0.1", port, "job", interval_s=0.1)
    task = asyncio.create_task(watcher.run())
    try:
        await asyncio.sleep(0.5)
        assert watcher() is None  # no host yet: unknown, and the watcher keeps trying
        store = await asyncio.to_thread(open_server, "127.0.0.1", port)
        node = lambda addr: codec.NodeId(addr, 100, 0)  # noqa: E731
        state = codec.RendezvousState(
            round=3,
            complete=True,
            participants={node("10.0.0.1"): 0, node("10.0.0.2"): 1},
            wait_list=frozenset({codec.NodeId(codec.MARKER_ADDR, 1, 0)}),
        )
        await asyncio.to_thread(store.set, keys.torch_state_key("job"), codec.encode(state))
        await wait_until(lambda: watcher() == (3, 2))
        state = codec.RendezvousState(round=4, complete=True, participants={node("10.0.0.1"): 0})
        await asyncio.to_thread(store.set, keys.torch_state_key("job"), codec.encode(state))
        await wait_until(lambda: watcher() == (4, 1))
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
