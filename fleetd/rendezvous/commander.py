"""Carries the planner's training-side actions to the nodes (reconcile.ports.NodeCommander).

- checkpoint: a request in the rendezvous store. Every rank reads it within one step, so no agent
  and no broker is in the path of the one thing that protects training progress.
- drain: a ``drain`` command to the node's agent, which runs the same emergency path as on a
  spot notice (checkpoint with hold, upload its shard, wait for leave, stop its tree): the node's
  interruption starts at ``Phase.NOTICED`` (fleetd.protocol.interruption); the steering's leave,
  sent on the wire by ``tell_leave``, moves it to ``Phase.LEAVE_ORDERED``.
- stop: one coordinated checkpoint with hold, wait (bounded) until that step is durable in S3,
  then ``shutdown`` to every agent and close the rendezvous. This takes seconds to minutes, so it
  runs in the commander's own task (a daemon component): a reconcile pass never waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from fleetd.intake.mqtt import BusUnavailable
from fleetd.intake.registry import NodeRegistry
from fleetd.intake.signals import TrainingSignals
from fleetd.protocol.interruption import Phase
from fleetd.protocol.messages import Command, DrainCommand, LeaveCommand, ShutdownCommand
from fleetd.reconcile.ports import NotDelivered
from fleetd.rendezvous.client import RendezvousClient
from fleetd.rendezvous.errors import RendezvousError
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

POLL_S = 0.5
SAVE_TIMEOUT_S = 60.0  # every rank saves within a step or two; a minute means something is wrong
DURABLE_TIMEOUT_S = 90.0


def _short(reason: str, limit: int = 200) -> str:
    """Store values carry a bounded reason (CheckpointRequest.reason); the log keeps it whole."""
    return reason if len(reason) <= limit else reason[: limit - 1] + "…"


def _utc(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


class TrainingCommander:
    def __init__(
        self,
        rendezvous: RendezvousClient,
        send: Callable[[Command], Awaitable[None]],
        registry: NodeRegistry,
        signals: TrainingSignals,
        *,
        close_rendezvous: Callable[[], Awaitable[None]] | None = None,
        reopen_rendezvous: Callable[[], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.rendezvous = rendezvous
        self.send = send
        self.registry = registry
        self.signals = signals
        self.close_rendezvous = close_rendezvous
        self.reopen_rendezvous = reopen_rendezvous
        self.clock = clock
        self._stops: asyncio.Queue[str] = asyncio.Queue()
        self.stop_done = asyncio.Event()
        self._stopping: asyncio.Task[None] | None = None  # the stop sequence under way

    # ------------------------------------------------------------------ NodeCommander
    async def request_checkpoint(self, deadline: float | None, reason: str) -> None:
        await self.rendezvous.request_checkpoint(_short(reason), by="fleetd")
        self.signals.note_checkpoint_request(self.clock())

    async def drain(self, instance_id: str, deadline: float | None, reason: str, msg_id: str | None = None) -> None:
        ids: dict[str, Any] = {"msg_id": msg_id} if msg_id else {}
        if not await self._send(DrainCommand(instance_id=instance_id, reason=reason, deadline=_utc(deadline), **ids)):
            raise NotDelivered(f"drain for {instance_id}: broker unavailable")
        log.info("interruption_ordered", instance_id=instance_id, phase=str(Phase.NOTICED), reason=reason)

    def node_state(self, instance_id: str) -> str | None:
        rec = self.registry.record(instance_id)
        return rec.status.state if rec is not None and rec.status is not None else None

    async def stop_job(self, reason: str) -> None:
        self._stops.put_nowait(reason)

    async def resume_job(self, reason: str) -> None:
        """A stop undone (a team's pause ended, fleetd/team/member.py): stops pending from it are
        dropped, the next stop runs its sequence again, and the rendezvous takes nodes again (it
        was closed for good at the stop, so a fresh node's torchrun would find it closed)."""
        while not self._stops.empty():
            self._stops.get_nowait()
        if self._stopping is not None and not self._stopping.done():
            # Still waiting for the stop's checkpoint: the job goes on instead; a sequence left
            # running would shut the resumed nodes down and close the rendezvous on them.
            self._stopping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stopping
        self.stop_done.clear()
        self.signals.note_stop_completed(None)
        if self.reopen_rendezvous is not None:
            await self.reopen_rendezvous()
        log.warning("job_resumed", reason=reason)

    async def tell_leave(self, addr: str, reason: str) -> None:
        """Steering removed ``addr`` from the rendezvous: say so on the wire too (the store key
        already tells fleetd's agents; the command makes the decision visible to operators)."""
        for rec in self.registry.records():
            if rec.status is not None and rec.status.node_addr == addr:
                if await self._send(LeaveCommand(instance_id=rec.instance_id, reason=reason)):
                    log.info("interruption_ordered", instance_id=rec.instance_id, phase=str(Phase.LEAVE_ORDERED))
                return

    # ------------------------------------------------------------------ component
    async def run(self, ctx: Any) -> None:
        while True:
            reason = await self._stops.get()
            if self.stop_done.is_set():
                continue  # the planner re-issues StopJob until the nodes are gone; once is enough
            self._stopping = asyncio.create_task(self._stop(reason), name="stop-sequence")
            try:
                await self._stopping
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if me is not None and me.cancelling():
                    raise  # this component is being cancelled (the sequence with it), not by a resume
                log.warning("stop_cancelled", reason=reason, why="the job resumed before its stop finished")

    async def _stop(self, reason: str) -> None:
        try:
            clean = await self._stop_sequence(reason)
        except RendezvousError as exc:
            log.error("stop_checkpoint_failed", error=str(exc), why="shutting nodes down anyway")
            await self._shutdown_agents(reason)
            clean = False
        self.stop_done.set()
        if clean:
            # Checkpoint durable and every agent told to shut down: nothing is left to wait for,
            # so the planner releases the nodes now instead of at the stop reserve.
            self.signals.note_stop_completed(self.clock())

    async def _stop_sequence(self, reason: str) -> bool:
        """True when the stop's checkpoint is durable and every agent was told to shut down."""
        seq = await self.rendezvous.request_checkpoint(_short(reason), hold=True, by="fleetd")
        self.signals.note_checkpoint_request(self.clock())
        step = await self._wait_saved(seq)
        durable = False
        if step is None:
            log.error("stop_checkpoint_not_saved", seq=seq, why="the last durable checkpoint stands")
        else:
            durable = await self._wait_durable(step)
            log.warning("stop_checkpoint", step=step, durable=durable)
        told = await self._shutdown_agents(reason)
        if self.close_rendezvous is not None:
            await self.close_rendezvous()
        log.warning("job_stopped", reason=reason)
        return durable and told

    async def _wait_saved(self, seq: int) -> int | None:
        deadline = time.monotonic() + SAVE_TIMEOUT_S
        while time.monotonic() < deadline:
            acks = await self.rendezvous.acks(seq)
            if acks and len({a.rank for a in acks}) >= acks[0].world_size:
                return max(a.step for a in acks)
            await asyncio.sleep(POLL_S)
        return None

    async def _wait_durable(self, step: int) -> bool:
        deadline = time.monotonic() + DURABLE_TIMEOUT_S
        while time.monotonic() < deadline:
            self.signals.snapshot()  # folds in checkpoint-uploaded events as they arrive
            if self.signals.durable_step is not None and self.signals.durable_step >= step:
                return True
            await asyncio.sleep(POLL_S)
        return False

    async def _shutdown_agents(self, reason: str) -> bool:
        """False when a command could not be handed to the broker."""
        told = True
        for rec in self.registry.records():
            if rec.tracked and rec.agent_offline_at is None and rec.ec2_state not in ("terminated", "shutting-down"):
                told = await self._send(ShutdownCommand(instance_id=rec.instance_id, reason=reason)) and told
        return told

    async def _send(self, command: Command) -> bool:
        try:
            await self.send(command)
        except BusUnavailable as exc:
            # Level-based: the planner (or, for a drain, the journal) re-issues what is still needed.
            log.warning("command_not_sent", kind=command.kind, instance_id=command.instance_id, error=str(exc))
            return False
        return True
