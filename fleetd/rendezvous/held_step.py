"""Have the nodes that stay saved the step their leavers held? (The steering's side of
agent/trainer/hold_plan.py.)

With replicated state a leaver stops at the hold's step and leaves without waiting for the
staying nodes' save. The steering must not poke those nodes (torchrun then restarts their
workers) before their copies are written: a worker stopped mid-save leaves the step unsaved, and
the job resumes from an older one. So while a leave is under way the steering reads the hold's
acks, each rank's once (a 2,000-rank wave reads 2,000 keys once, not every pass).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetd.protocol import rendezvous_keys as keys
from fleetd.rendezvous.client import RendezvousClient

MAX_RANKS = 4096  # as agent/trainer/store_link.py reads them
LOOK_BACK = 8  # requests searched for the hold that names a leaver (a wave adds one per node)


@dataclass
class HeldStepWatch:
    seq: int | None = None
    request: keys.CheckpointRequest | None = None
    acks: dict[int, keys.CheckpointAck] = field(default_factory=dict)  # by rank
    scanned_to: int = 0  # requests up to this number were read

    async def unsaved(
        self, client: RendezvousClient, members: frozenset[str], leaving: frozenset[str]
    ) -> frozenset[str]:
        """Members that stay and have not acknowledged, with a saved copy, the newest hold that
        protects a leave, while nodes are told to leave (``leaving``). Empty when none is found."""
        if not leaving or not members:
            self.seq, self.request, self.acks = None, None, {}  # no leave under way: forget the last
            return frozenset()
        await self._find_hold(client)
        if self.seq is None or self.request is None:
            return frozenset()
        await self._read_new_acks(client, self.seq)
        saved = {a.node_addr for a in self.acks.values() if not a.held_only}
        stay = members - leaving - set(self.request.leaving)
        return frozenset(stay - saved)

    async def _find_hold(self, client: RendezvousClient) -> None:
        """Scan the requests not seen yet, oldest first; the newest hold naming leavers wins (in
        a wave, the staying nodes answer every later one with the step they saved)."""
        newest = await client.latest_request_seq()
        for seq in range(max(self.scanned_to, newest - LOOK_BACK) + 1, newest + 1):
            req = await client.request(seq)
            if req is None:
                return  # numbered, not written yet (the writer bumps the number first): next pass
            self.scanned_to = seq
            if req.hold and req.leaving:
                self.seq, self.request, self.acks = seq, req, {}

    async def _read_new_acks(self, client: RendezvousClient, seq: int) -> None:
        count = await client.ack_count(seq)
        span = max(count, 1)
        while len(self.acks) < count:
            # The first ack read tells the world's size; before it, widen the ranks read.
            world = max((a.world_size for a in self.acks.values()), default=span)
            wanted = [r for r in range(min(world, MAX_RANKS)) if r not in self.acks]
            keys_by_rank = {r: keys.ack_key(client.run_id, seq, r) for r in wanted}
            raw = await client.read_keys(list(keys_by_rank.values()))
            for rank, key in keys_by_rank.items():
                ack = client.parse(keys.CheckpointAck, key, raw.get(key))
                if ack is not None and ack.seq == seq and ack.rank == rank:
                    self.acks[rank] = ack
            if self.acks and max(a.world_size for a in self.acks.values()) <= world or span >= MAX_RANKS:
                return  # read every rank of the world (the rest are not written yet)
            span *= 2
