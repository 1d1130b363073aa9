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

The columns come from schema version 2 (fleetd.reconcile.schema).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from fleetd.reconcile.state import StateStore


@dataclass(frozen=True, slots=True)
class DrainRecord:
    instance_id: str
    started_at: float
    deadline: float | None
    reason: str
    sent_at: float | None


async def record_drain(state: StateStore, instance_id: str, now: float, deadline: float | None,
                       reason: str) -> DrainRecord:
    """Write the drain before it is sent; a drain already recorded for the node is kept as it was."""

    def tx(db: sqlite3.Connection) -> DrainRecord:
        db.execute(
            "UPDATE instances SET drain_deadline=CASE WHEN drain_started_at IS NULL THEN ? ELSE drain_deadline END,"
            " drain_reason=CASE WHEN drain_started_at IS NULL THEN ? ELSE drain_reason END,"
            " drain_started_at=COALESCE(drain_started_at, ?) WHERE instance_id=?",
            (deadline, reason, now, instance_id))
        return _drain_row(db, instance_id) or DrainRecord(instance_id, now, deadline, reason, None)

    return await state._run(tx)


async def mark_drain_sent(state: StateStore, instance_id: str, now: float) -> None:
    await state._run(lambda db: db.execute(
        "UPDATE instances SET drain_sent_at=COALESCE(drain_sent_at, ?) WHERE instance_id=?", (now, instance_id)))


async def unsent_drains(state: StateStore) -> list[DrainRecord]:
    """Drains recorded for open instances and not known to have reached the node."""

    def q(db: sqlite3.Connection) -> list[DrainRecord]:
        rows = db.execute(
            "SELECT instance_id, drain_started_at, drain_deadline, COALESCE(drain_reason, ''), drain_sent_at"
            " FROM instances WHERE drain_started_at IS NOT NULL AND drain_sent_at IS NULL AND ended_at IS NULL"
            " AND terminate_requested_at IS NULL ORDER BY instance_id")
        return [DrainRecord(*r) for r in rows]

    return await state._run(q)


async def unfinished_terminations(state: StateStore, before: float) -> list[str]:
    """Instances fleetd asked EC2 to terminate before ``before`` that the last sync still saw
    pending or running (a crash between the record and the call, or a call that failed)."""
    return await state._run(lambda db: [r[0] for r in db.execute(
        "SELECT instance_id FROM instances WHERE terminate_requested_at IS NOT NULL AND terminate_requested_at < ?"
        " AND ended_at IS NULL AND ec2_state IN ('pending', 'running') ORDER BY instance_id", (before,))])


def drain_msg_id(record: DrainRecord) -> str:
    """The same drain always carries the same message id (a re-send is recognisably the same)."""
    return f"drain-{record.instance_id}-{int(record.started_at * 1000)}"[:64]


def _drain_row(db: sqlite3.Connection, instance_id: str) -> DrainRecord | None:
    r = db.execute("SELECT instance_id, drain_started_at, drain_deadline, COALESCE(drain_reason, ''), drain_sent_at"
                   " FROM instances WHERE instance_id=?", (instance_id,)).fetchone()
    return DrainRecord(*r) if r is not None and r[1] is not None else None
