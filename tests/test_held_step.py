"""The steering reads which staying members saved the step their leavers held
(fleetd/rendezvous/held_step.py), over a real store host: the leavers' trainers no longer wait
for that save (agent/trainer/hold_plan.py), so the steering must before it pokes."""

from __future__ import annotations

import asyncio

from agent.trainer.store_link import StoreLink
from fleetd.protocol import rendezvous_keys as keys
from fleetd.rendezvous.client import RendezvousClient
from fleetd.rendezvous.held_step import HeldStepWatch
from tests.test_rendezvous_host import RUN, host  # noqa: F401 (fixture)

A, B, C, D = "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"


def ack(seq: int, rank: int, addr: str, *, held_only: bool = False) -> keys.CheckpointAck:
    return keys.CheckpointAck(seq=seq, step=9, rank=rank, world_size=3, node_addr=addr, held_only=held_only)


async def test_staying_members_are_unsaved_until_they_acknowledge_with_a_copy(host) -> None:  # noqa: F811
    port, _ = host
    link = await asyncio.to_thread(StoreLink("127.0.0.1", port, RUN).connect)
    members, leaving = frozenset({A, B, C}), frozenset({A})
    watch = HeldStepWatch()
    async with RendezvousClient("127.0.0.1", port, RUN) as client:
        assert await watch.unsaved(client, members, leaving) == frozenset()  # no hold names A
        await asyncio.to_thread(link.request_checkpoint, "periodic")
        seq = await asyncio.to_thread(link.request_checkpoint, "spot notice", hold=True, leaving=(A,), by=A)
        await asyncio.to_thread(link.request_checkpoint, "join", hold=True, by=D)  # names no leaver
        assert await watch.unsaved(client, members, leaving) == {B, C}
        # The leaver's rank stopped without saving; C saved.
        await asyncio.to_thread(link.ack, ack(seq, 0, A, held_only=True))
        await asyncio.to_thread(link.ack, ack(seq, 2, C))
        assert await watch.unsaved(client, members, leaving) == {B}
        await asyncio.to_thread(link.ack, ack(seq, 1, B))
        assert await watch.unsaved(client, members, leaving) == frozenset()
        # A later notice of the wave (B) is the hold waited on from then: B leaves too, C stays.
        seq2 = await asyncio.to_thread(link.request_checkpoint, "spot notice", hold=True, leaving=(B,), by=B)
        assert await watch.unsaved(client, members, frozenset({A, B})) == {C}
        await asyncio.to_thread(link.ack, ack(seq2, 2, C))
        assert await watch.unsaved(client, members, frozenset({A, B})) == frozenset()
