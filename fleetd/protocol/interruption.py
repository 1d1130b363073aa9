"""One interruption as a typed state machine: the phases a leaving node goes through and the moves
allowed between them (DESIGN.md "One interruption, end to end").

The node's agent advances its phase with :func:`advance` (agent/supervise/emergency.py); fleetd
cannot see every phase, only the drain keys (rendezvous_keys), and reads the furthest one they show
with :func:`store_phase` (fleetd/rendezvous/decide.py, steering.py). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum


class Phase(StrEnum):
    NOTICED = "noticed"  # a spot notice or a drain: the flow started (members write ``noticed``)
    CHECKPOINT_REQUESTED = "checkpoint_requested"  # a member asked for a checkpoint with ``hold``
    ACKED = "acked"  # the ranks acknowledged step N
    NO_ACK = "no_ack"  # nobody acknowledged within half the notice (the world was re-forming)
    UPLOADED = "uploaded"  # this node's shard upload of step N ended (before drain_ready)
    DRAIN_READY = "drain_ready"  # the ``drain_ready`` key is written: fleetd may remove the node
    LEAVE_ORDERED = "leave_ordered"  # fleetd's ``leave`` (store key or MQTT command)
    STOPPED = "stopped"  # the process tree is stopped (SIGKILL; SIGTERM when no step was acked)
    NEWEST_LOCAL_UPLOADED = "newest_local_uploaded"  # no ack: the newest local step uploaded instead
    LEFT = "left"  # the ``left`` key is written: fleetd pokes the survivors


P = Phase
# Every phase before the tree is stopped may go straight to STOPPED: the store became unreachable,
# or (from DRAIN_READY) fleetd's leave did not come in time. The tree is stopped either way.
TRANSITIONS: Mapping[Phase, frozenset[Phase]] = {
    # A node that is not a member (a replacement still restoring), or folder mode (nobody answers a
    # coordinated checkpoint), asks for none: drain_ready with no acknowledged step.
    P.NOTICED: frozenset({P.CHECKPOINT_REQUESTED, P.DRAIN_READY, P.STOPPED}),
    P.CHECKPOINT_REQUESTED: frozenset({P.ACKED, P.NO_ACK, P.STOPPED}),
    # Sharded state uploads before drain_ready; replicated state with a survivor (or no local copy)
    # says drain_ready at once and uploads on the way out.
    P.ACKED: frozenset({P.UPLOADED, P.DRAIN_READY, P.STOPPED}),
    P.NO_ACK: frozenset({P.DRAIN_READY, P.STOPPED}),
    P.UPLOADED: frozenset({P.DRAIN_READY, P.STOPPED}),
    P.DRAIN_READY: frozenset({P.LEAVE_ORDERED, P.STOPPED}),
    P.LEAVE_ORDERED: frozenset({P.STOPPED}),
    P.STOPPED: frozenset({P.NEWEST_LOCAL_UPLOADED, P.LEFT}),
    P.NEWEST_LOCAL_UPLOADED: frozenset({P.LEFT}),
    P.LEFT: frozenset(),
}
START = Phase.NOTICED
TERMINAL = frozenset(p for p, nxt in TRANSITIONS.items() if not nxt)
# The phases fleetd counts as out of the training world: it removes the node, or already did.
OUT = frozenset({Phase.DRAIN_READY, Phase.LEAVE_ORDERED, Phase.LEFT})


class IllegalTransition(ValueError):
    """A move the table does not allow (a bug in the flow that asked for it)."""


def advance(current: Phase, new: Phase) -> Phase:
    """``new`` when the table allows ``current -> new``; else raise :class:`IllegalTransition`."""
    allowed = TRANSITIONS[current]
    if new not in allowed:
        exits = ", ".join(sorted(allowed)) or "none: it is terminal"
        raise IllegalTransition(f"interruption phase {current} cannot go to {new} (allowed: {exits})")
    return new


def reachable(current: Phase, target: Phase) -> bool:
    """Is ``target`` ``current`` or reachable from it? The store shows only some phases, so fleetd
    sees a node jump (NOTICED -> DRAIN_READY); a jump backwards means the keys were lost."""
    seen, todo = {current}, [current]
    while todo:
        for nxt in TRANSITIONS[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return target in seen


def store_phase(
    *, noticed: bool = False, drain_ready: bool = False, leave: bool = False, left: bool = False
) -> Phase | None:
    """The furthest phase a node's keys in the rendezvous store show (None: no interruption).
    The agent writes ``noticed``, ``drain_ready`` and ``left`` in that order and fleetd writes
    ``leave`` between the last two, so the newest key present is the node's phase."""
    if left:
        return Phase.LEFT
    if leave:
        return Phase.LEAVE_ORDERED
    if drain_ready:
        return Phase.DRAIN_READY
    return Phase.NOTICED if noticed else None
