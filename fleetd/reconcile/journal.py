"""What the controller started and had not finished when it stopped: drains and terminations.

A drain is written *before* its command is sent (``drain_started_at``, with its deadline and
reason) and marked sent after (``drain_sent_at``). So whatever instant ``fleetd run`` dies at:

- before the record: nothing happened; the next pass plans the drain again (level-based);
- after the record, before the send: the node already counts as draining (the planner never
  plans a second drain for it); the journal sends the recorded drain once it is sure the agent did
  not get it (no "draining"/"leaving" status after a grace period);
- after the send, before the mark: the agent's status says it is draining, so the drain is marked
  sent without sending it again.

A termination is written before TerminateInstances (``terminate_requested_at``); one that a crash
cut off is re-sent (TerminateInstances is idempotent) once it is overdue, so a node fleetd decided
to let go of never keeps billing.

The columns come from schema version 2 (fleetd.reconcile.schema); each state backend
(fleetd.reconcile.state_port.StateBackend) implements the four journal operations.
"""

from __future__ import annotations

from fleetd.reconcile.state_port import StateBackend
from fleetd.reconcile.state_rows import DrainRecord

__all__ = ["DrainRecord", "drain_msg_id", "mark_drain_sent", "record_drain", "unfinished_terminations", "unsent_drains"]


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
