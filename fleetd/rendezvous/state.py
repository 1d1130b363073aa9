"""torchrun's c10d rendezvous state as plain data, and the edits fleetd makes to it.

torch keeps the state of run ``<run_id>`` under the store key ``torch.rendezvous.<run_id>`` as
base64(pickle(_RendezvousState)) (torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py,
dynamic_rendezvous.py). Every writer uses compare-and-set on the whole value, so fleetd can
read-modify-write it like any node does. This module only converts and transforms; the store I/O is
in :mod:`fleetd.rendezvous.client`.

The store is unauthenticated, so the value is untrusted: it is unpickled only by the one allow-list
decoder the agent shares (fleetd/shared/rendezvous_pickle.py), never with a bare ``pickle.loads``.
"""

from __future__ import annotations

import base64
import pickle
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, overload

from fleetd.protocol.errors import ProtocolError
from fleetd.rendezvous.errors import RendezvousStateError
from fleetd.shared.rendezvous_pickle import NULL_SENTINEL, unpickle_rendezvous_state

# NULL_SENTINEL is the decoder's; it is named here too, where the rest of the codec is.
__all__ = ["MARKER_ADDR", "NULL_SENTINEL", "NodeId", "RendezvousState", "decode", "encode"]

# fleetd's own entries in the wait list. torchrun restarts healthy workers when the wait list is
# non-empty (elastic agent, "membership changes do not count as retries"), so a marker there is
# how fleetd makes the survivors re-form right after a node left, instead of after their next
# collective fails against the departed peer (which burns a --max-restarts attempt).
MARKER_ADDR = "fleetd-steer"


@dataclass(frozen=True, slots=True, order=True)
class NodeId:
    """torch's _NodeDesc: field order matters, ranks are assigned in this sort order."""

    addr: str
    pid: int
    local_id: int

    def __str__(self) -> str:
        return f"{self.addr}_{self.pid}_{self.local_id}"

    @property
    def is_marker(self) -> bool:
        return self.addr == MARKER_ADDR


@dataclass(frozen=True, slots=True)
class RendezvousState:
    """What fleetd observes of one rendezvous (and writes back after a transform)."""

    round: int = 0
    complete: bool = False
    deadline: datetime | None = None
    closed: bool = False
    participants: dict[NodeId, int] = field(default_factory=dict)
    wait_list: frozenset[NodeId] = frozenset()
    redundancy_list: frozenset[NodeId] = frozenset()
    last_heartbeats: dict[NodeId, datetime] = field(default_factory=dict)

    # ------------------------------------------------------------------ views
    @property
    def participant_addrs(self) -> frozenset[str]:
        return frozenset(n.addr for n in self.participants)

    @property
    def waiting(self) -> frozenset[NodeId]:
        """Real nodes waiting for the next round (fleetd's markers excluded)."""
        return frozenset(n for n in self.wait_list if not n.is_marker)

    @property
    def has_marker(self) -> bool:
        return any(n.is_marker for n in self.wait_list)

    def ranks_by_addr(self) -> dict[str, int]:
        return {n.addr: r for n, r in self.participants.items()}

    def stale(self, now: datetime, older_than: timedelta) -> frozenset[NodeId]:
        """Real nodes whose last heartbeat is older than ``older_than``."""
        return frozenset(n for n, t in self.last_heartbeats.items() if not n.is_marker and now - t > older_than)

    # ------------------------------------------------------------------ transforms (pure)
    def without_addrs(self, addrs: frozenset[str] | set[str], min_nodes: int = 1) -> RendezvousState:
        """Remove every node at these addresses, as torch's own exit op would (same epilogue)."""
        gone = {n for n in self._all_nodes() if n.addr in addrs}
        return self._without(gone, min_nodes)

    def without_nodes(self, nodes: frozenset[NodeId] | set[NodeId], min_nodes: int = 1) -> RendezvousState:
        return self._without(set(nodes), min_nodes)

    def _without(self, gone: set[NodeId], min_nodes: int) -> RendezvousState:
        if not gone:
            return self
        participants = {n: r for n, r in self.participants.items() if n not in gone}
        s = replace(
            self,
            participants=participants,
            wait_list=frozenset(n for n in self.wait_list if n not in gone),
            redundancy_list=frozenset(n for n in self.redundancy_list if n not in gone),
            last_heartbeats={n: t for n, t in self.last_heartbeats.items() if n not in gone},
        )
        removed_participant = len(participants) != len(self.participants)
        if not removed_participant:
            return s
        # torch's _remove_participant_epilogue.
        if s.complete and not participants:
            return replace(s, complete=False, round=s.round + 1)
        if not s.complete and len(participants) < min_nodes:
            return replace(s, deadline=None)
        return s

    def with_marker(self, now: datetime, tag: int) -> RendezvousState:
        """Add a fleetd marker to the wait list; its heartbeat lets nodes expire it by themselves
        if fleetd dies before removing it."""
        marker = NodeId(MARKER_ADDR, 0, tag)
        return replace(
            self,
            wait_list=self.wait_list | {marker},
            last_heartbeats={**self.last_heartbeats, marker: now},
        )

    def poked(self, now: datetime) -> RendezvousState:
        """The survivors' poke: the next round, already open with this round's participants out
        of it, and a marker in its wait list so that every agent restarts its workers.

        A marker alone (the round left complete) made each agent exit the round by itself: the
        first ones out wait-list themselves until the last one leaves and opens the next round,
        then each needs one more 0.1 s poll to see it and join. That chain cost 0.7-2 s of a
        notice's re-form (docs/measurements/2026-11-rendezvous.md). Opened here in one write,
        each agent's exit finds nothing to do and its join adds it to the open round at once.
        The agents lose nothing: torch's own exit op would remove them the same way."""
        return self.without_nodes(set(self.participants)).with_marker(now, self.round)

    def without_markers(self) -> RendezvousState:
        return self._without({n for n in self.wait_list if n.is_marker}, min_nodes=1)

    def completed(self) -> RendezvousState:
        """Mark the round complete now and assign ranks, exactly as torch does (sorted nodes)."""
        ranks = {n: r for r, n in enumerate(sorted(self.participants))}
        return replace(self, complete=True, deadline=None, participants=ranks)

    def closed_for_good(self) -> RendezvousState:
        return replace(self, closed=True)

    def _all_nodes(self) -> set[NodeId]:
        return set(self.participants) | set(self.wait_list) | set(self.redundancy_list) | set(self.last_heartbeats)


# ---------------------------------------------------------------------- codec
@overload
def _utc(t: datetime) -> datetime: ...
@overload
def _utc(t: None) -> None: ...
def _utc(t: datetime | None) -> datetime | None:
    if t is None:
        return None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


_NODE_IDS: dict[tuple[str, int, int], NodeId] = {}


def decode(raw: bytes) -> RendezvousState | None:
    """Decode the stored value; None when torch has created the key but no state yet."""
    try:
        obj = unpickle_rendezvous_state(raw)
    except ProtocolError as exc:
        # The rendezvous adapter's callers handle their own error type (errors.py).
        raise RendezvousStateError(str(exc)) from None
    if obj is None:
        return None
    try:

        def nid(d: Any) -> NodeId:  # one of torch's _NodeDesc
            # The same nodes come back in every read (the steering decodes the state ~20 times a
            # second; at 1,000 members building 2,000 NodeIds was most of a 60 ms decode).
            key = (d.addr, d.pid, d.local_id)
            n = _NODE_IDS.get(key)
            if n is None:
                if len(_NODE_IDS) > 100_000:
                    _NODE_IDS.clear()
                n = _NODE_IDS[key] = NodeId(str(d.addr), int(d.pid), int(d.local_id))
            return n

        return RendezvousState(
            round=int(obj.round),
            complete=bool(obj.complete),
            deadline=_utc(obj.deadline),
            closed=bool(obj.closed),
            participants={nid(n): int(r) for n, r in obj.participants.items()},
            wait_list=frozenset(nid(n) for n in obj.wait_list),
            redundancy_list=frozenset(nid(n) for n in getattr(obj, "redundancy_list", set())),
            last_heartbeats={nid(n): _utc(t) for n, t in obj.last_heartbeats.items()},
        )
    except (AttributeError, TypeError, ValueError) as exc:
        raise RendezvousStateError(f"rendezvous state has an unexpected shape: {exc}") from None


def encode(state: RendezvousState) -> bytes:
    """Encode as torch would (base64 of the pickled torch object), ready for compare_set."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _NodeDesc,
        _RendezvousState,
    )

    def desc(n: NodeId) -> _NodeDesc:
        return _NodeDesc(n.addr, n.pid, n.local_id)

    obj = _RendezvousState()
    obj.round = state.round
    obj.complete = state.complete
    obj.deadline = state.deadline
    obj.closed = state.closed
    obj.participants = {desc(n): r for n, r in state.participants.items()}
    obj.wait_list = {desc(n) for n in state.wait_list}
    obj.redundancy_list = {desc(n) for n in state.redundancy_list}
    obj.last_heartbeats = {desc(n): t for n, t in state.last_heartbeats.items()}
    return base64.b64encode(pickle.dumps(obj))
