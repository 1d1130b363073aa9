"""Have the nodes that stay saved the step their leavers held? (The steering's side of
agent/trainer/hold_plan.py.)

With replicated state a leaver stops at the hold's step and leaves without waiting for the
staying nodes' save. The steering must not poke those nodes (torchrun then restarts their
workers) before their copies are written: a worker stopped mid-save leaves the step unsaved, and
the job resumes from an older one. So while a leave is under way the steering reads the acks of
the hold that names a node told to leave. Requests are read once each; the acks again only when
their count grew, at most every ``REREAD_S`` (a 2,000-rank wave is a few reads, not one a pass).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fleetd.protocol import rendezvous_keys as keys
from fleetd.rendezvous.client import RendezvousClient

MAX_RANKS = 4096  # as agent/trainer/store_link.py reads them
LOOK_BACK = 8  # requests searched for the hold that names a leaver (a wave adds one per node)
REREAD_S = 0.25


@dataclass
class HeldStepWatch:
    seq: int | None = None
    request: keys.CheckpointRequest | None = None
    acks: dict[int, keys.CheckpointAck] = field(default_factory=dict)  # by rank
    count: int = 0  # the ack count when last read
    read_at: float = 0.0  # monotonic
    requests: dict[int, keys.CheckpointRequest] = field(default_factory=dict)  # the last LOOK_BACK read
    scanned_to: int = 0

    async def unsaved(
        self, client: RendezvousClient, members: frozenset[str], leaving: frozenset[str]
    ) -> frozenset[str]:
        """Members that stay and have not acknowledged, with a copy written, the newest hold that
        names a node told to leave (``leaving``). Empty when there is none, or when no rank
        answered it: nobody is saving for a hold the world never reached."""
        if not leaving or not members:
            self.seq, self.request = None, None
            return frozenset()
        await self._scan(client)
        held = [s for s, r in self.requests.items() if r.hold and leaving & set(r.leaving)]
        if not held:
            return frozenset()
        if max(held) != self.seq:
            self.seq, self.acks, self.count, self.read_at = max(held), {}, 0, 0.0
        self.request = self.requests[max(held)]
        await self._read_new_acks(client, max(held))
        if not self.acks:
            return frozenset()
        saved = {a.node_addr for a in self.acks.values() if not a.held_only}
        return frozenset(members - leaving - set(self.request.leaving) - saved)

    async def _scan(self, client: RendezvousClient) -> None:
        """Read the requests numbered since the last scan (the last LOOK_BACK at most)."""
        newest = await client.latest_request_seq()
        for seq in range(max(self.scanned_to, newest - LOOK_BACK) + 1, newest + 1):
            req = await client.request(seq)
            if req is None:
                break  # numbered, not written yet (the writer bumps the number first): next pass
            self.requests[seq] = req
            self.scanned_to = seq
        for seq in [s for s in self.requests if s <= self.scanned_to - LOOK_BACK]:
            del self.requests[seq]

    async def _read_new_acks(self, client: RendezvousClient, seq: int) -> None:
        count = await client.ack_count(seq)
        now = time.monotonic()
        if count <= self.count or (self.acks and now - self.read_at < REREAD_S):
            return
        self.read_at = now
        span = max(count, 1)
        while True:
            # The first ack read tells the world's size; before it, widen the ranks read.
            world = max((a.world_size for a in self.acks.values()), default=span)
            wanted = [r for r in range(min(world, MAX_RANKS)) if r not in self.acks]
            keys_by_rank = {r: keys.ack_key(client.run_id, seq, r) for r in wanted}
            raw = await client.read_keys(list(keys_by_rank.values()))
            for rank, key in keys_by_rank.items():
                ack = client.parse(keys.CheckpointAck, key, raw.get(key))
                if ack is not None and ack.seq == seq and ack.rank == rank:
                    self.acks[rank] = ack
            known = max((a.world_size for a in self.acks.values()), default=0)
            if (self.acks and known <= world) or span >= MAX_RANKS or len(self.acks) >= count:
                break  # every rank of the world read (the rest are not written yet)
            span *= 2
        self.count = len(self.acks)
