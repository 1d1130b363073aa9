"""The steering reads which staying members saved the step their leavers held
(fleetd/rendezvous/held_step.py), over a real store host: the leavers' trainers no longer wait
for that save (agent/trainer/hold_plan.py), so the steering must before it pokes."""

from __future__ import annotations

import asyncio

from agent.trainer.store_link import StoreLink
from fleetd.protocol import rendezvous_keys as keys
from fleetd.rendezvous import held_step
from fleetd.rendezvous.client import RendezvousClient
from fleetd.rendezvous.held_step import HeldStepWatch
from tests.test_rendezvous_host import RUN, host  # noqa: F401 (fixture)

A, B, C, D = "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"


def ack(seq: int, rank: int, addr: str, *, held_only: bool = False) -> keys.CheckpointAck:
    return keys.CheckpointAck(seq=seq, step=9, rank=rank, world_size=3, node_addr=addr, held_only=held_only)


async def test_staying_members_are_unsaved_until_they_acknowledge_with_a_copy(host, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setattr(held_step, "REREAD_S", 0.0)
    port, _ = host
    link = await asyncio.to_thread(StoreLink("127.0.0.1", port, RUN).connect)
    members, leaving = frozenset({A, B, C}), frozenset({A})
    watch = HeldStepWatch()
    async with RendezvousClient("127.0.0.1", port, RUN) as client:
        assert await watch.unsaved(client, members, leaving) == frozenset()  # no request yet
        await asyncio.to_thread(link.request_checkpoint, "periodic")
        seq = await asyncio.to_thread(link.request_checkpoint, "spot notice", hold=True, leaving=(A,), by=A)
        await asyncio.to_thread(link.request_checkpoint, "join", hold=True, by=D)  # names no leaver
        # Not answered yet: nobody is saving for it (a hold the world never reached waits for nobody).
        assert await watch.unsaved(client, members, leaving) == frozenset()
        # The leaver's rank stopped without saving: the staying nodes are saving now.
        await asyncio.to_thread(link.ack, ack(seq, 0, A, held_only=True))
        assert await watch.unsaved(client, members, leaving) == {B, C}
        await asyncio.to_thread(link.ack, ack(seq, 2, C))
        assert await watch.unsaved(client, members, leaving) == {B}
        await asyncio.to_thread(link.ack, ack(seq, 1, B))
        assert await watch.unsaved(client, members, leaving) == frozenset()
        # A later notice of the wave (B), told to leave: its hold is the one waited on from then.
        seq2 = await asyncio.to_thread(link.request_checkpoint, "spot notice", hold=True, leaving=(B,), by=B)
        await asyncio.to_thread(link.ack, ack(seq2, 1, B))
        assert await watch.unsaved(client, members, frozenset({A, B})) == {C}
        await asyncio.to_thread(link.ack, ack(seq2, 2, C))
        assert await watch.unsaved(client, members, frozenset({A, B})) == frozenset()
        # The leave is over; a later one finds its own hold, even one numbered while the last ran.
        assert await watch.unsaved(client, members, frozenset()) == frozenset()
        seq3 = await asyncio.to_thread(link.request_checkpoint, "spot notice", hold=True, leaving=(C,), by=C)
        await asyncio.to_thread(link.ack, ack(seq3, 2, C, held_only=True))
        assert await watch.unsaved(client, members, frozenset({C})) == {A, B}


async def test_a_hold_numbered_during_one_leave_is_found_for_the_next(host, monkeypatch) -> None:  # noqa: F811
    """B's hold is written (and scanned) while A's leave runs; B is told only after A's poke."""
    monkeypatch.setattr(held_step, "REREAD_S", 0.0)
    port, _ = host
    link = await asyncio.to_thread(StoreLink("127.0.0.1", port, RUN).connect)
    members = frozenset({A, B, C})
    watch = HeldStepWatch()
    async with RendezvousClient("127.0.0.1", port, RUN) as client:
        seq_a = await asyncio.to_thread(link.request_checkpoint, "spot notice", hold=True, leaving=(A,), by=A)
        await asyncio.to_thread(link.ack, ack(seq_a, 0, A, held_only=True))
        seq_b = await asyncio.to_thread(link.request_checkpoint, "spot notice", hold=True, leaving=(B,), by=B)
        assert await watch.unsaved(client, members, frozenset({A})) == {B, C}
        assert await watch.unsaved(client, members, frozenset()) == frozenset()  # A's leave done
        await asyncio.to_thread(link.ack, ack(seq_b, 1, B, held_only=True))  # the next world's answer
        assert await watch.unsaved(client, members, frozenset({B})) == {A, C}
