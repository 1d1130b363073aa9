"""What the controller started and had not finished when it stopped: drains and terminations.

A drain is written before its command is sent (``drain_started_at``) and marked sent after
(``drain_sent_at``); a termination is written before TerminateInstances (``terminate_requested_at``).
So after a crash at any instant, what the agent or EC2 may not have got is sent once more
(docs/DESIGN.md "Controller restart"). The columns come from schema version 2
(fleetd.reconcile.schema); each state backend implements the journal operations.
"""

from __future__ import annotations

from fleetd.reconcile.state_port import StateBackend
from fleetd.reconcile.state_rows import DrainRecord

__all__ = ["DrainRecord", "drain_msg_id", "mark_drain_sent", "record_drain", "unfinished_terminations", "unsent_drains"]


# Written before the send: after a crash the node already counts as draining (no second drain is
# planned), and the drain is re-sent only if the agent never said draining/leaving.
async def record_drain(
    state: StateBackend, instance_id: str, now: float, deadline: float | None, reason: str
) -> DrainRecord:
    """Write the drain before it is sent; a drain already recorded for the node is kept as it was."""
    return await state.record_drain(instance_id, now, deadline, reason)


async def mark_drain_sent(state: StateBackend, instance_id: str, now: float) -> None:
    await state.mark_drain_sent(instance_id, now)


async def unsent_drains(state: StateBackend) -> list[DrainRecord]:
    """Drains recorded for open instances and not known to have reached the node."""
    return await state.unsent_drains()


async def unfinished_terminations(state: StateBackend, before: float) -> list[str]:
    """Instances fleetd asked EC2 to terminate before ``before`` that the last sync still saw
    pending or running (a crash between the record and the call, or a call that failed)."""
    return await state.unfinished_terminations(before)


def drain_msg_id(record: DrainRecord) -> str:
    """The same drain always carries the same message id (a re-send is recognisably the same)."""
    return f"drain-{record.instance_id}-{int(record.started_at * 1000)}"[:64]
