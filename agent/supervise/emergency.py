"""The node side of a spot notice: the agent acts without waiting for the controller.

(1) ask for a checkpoint with ``hold`` in the rendezvous store, (2) wait until every rank
acknowledged step N, (3) upload this node's files and say ``drain_ready``, (4) wait for fleetd's
leave, bounded by the notice, (5) stop torchrun's tree and say ``left``. With no acknowledged step
the tree gets SIGTERM and the newest local step is uploaded; a node that is not yet a member asks
for no checkpoint. Phases move through ``PhaseTrack``, each move logged.
(docs/DESIGN.md "One interruption, end to end", "A wave of notices")
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from agent.supervise.torchrun import TorchrunExit, TorchrunProcess
from agent.trainer import local_ckpt
from agent.trainer.store_link import StoreLink, StoreLinkError
from fleetd.protocol import interruption
from fleetd.protocol import rendezvous_keys as keys
from fleetd.protocol.interruption import Phase
from fleetd.shared.logs import get_logger
from fleetd.shared.waits import wait_set, within

log = get_logger(__name__)


class ShardUploader(Protocol):
    async def upload(self, step: int, directory: Path, *, deadline: datetime | None) -> bool:
        """Upload this node's files of ``step``; True when this node's shard is durable."""


@dataclass
class CheckpointStoreUploader:
    """ShardUploader over agent.checkpoint_store (one S3 writer per node)."""

    store: Any  # agent.checkpoint_store.store.CheckpointStore
    writer: str
    expected_writers: tuple[str, ...] | None = None  # None: replicated state, each node complete
    # Told the upload's result (the agent publishes it as checkpoint-uploaded): fleetd learns that
    # the notice's checkpoint is durable, as it does for periodic ones.
    on_uploaded: Callable[[Any], Awaitable[None]] | None = None

    async def upload(self, step: int, directory: Path, *, deadline: datetime | None) -> bool:
        files, step_files = await asyncio.to_thread(local_ckpt.upload_set, directory)
        # Raises on failure; returning means this node's receipt is written (its shard is safe).
        result = await self.store.upload_step(
            step,
            files,
            writer=self.writer,
            expected_writers=self.expected_writers,
            deadline=deadline,
            root=directory,
            step_files=step_files,
        )
        if self.on_uploaded is not None:
            await self.on_uploaded(result)
        return True


@dataclass(slots=True)
class _Leaving:
    """What one emergency learned so far; kept when the store fails half-way."""

    member: Any = None
    seq: int | None = None
    step: int | None = None
    held_only: bool = False  # this node's ranks stopped at ``step`` and saved nothing
    durable: bool = False
    detail: str = ""
    upload: asyncio.Task[tuple[bool, str]] | None = None


@dataclass(frozen=True, slots=True)
class EmergencyOutcome:
    step: int | None
    durable: bool
    left: bool
    timings: dict[str, float]  # seconds since the notice, per phase
    detail: str = ""
    phase: Phase = Phase.LEFT  # where the flow ended: STOPPED when ``left`` could not be written


@dataclass
class PhaseTrack:
    """One interruption's phase on this node, moved only along fleetd.protocol.interruption's
    table. An illegal move is a bug in the flow: it is logged as an error, and the flow goes on,
    because the node must stop its tree before the notice's deadline whatever the bookkeeping says."""

    node_addr: str
    phase: Phase = interruption.START
    history: list[Phase] = field(default_factory=lambda: [interruption.START])

    def to(self, new: Phase, **detail: Any) -> None:
        try:
            interruption.advance(self.phase, new)
        except interruption.IllegalTransition as exc:
            log.error("emergency_phase_illegal", node_addr=self.node_addr, error=str(exc))
        log.info("emergency_phase", node_addr=self.node_addr, phase=str(new), was=str(self.phase), **detail)
        self.phase = new
        self.history.append(new)


@dataclass
class EmergencyFlow:
    link: StoreLink
    node_addr: str
    torchrun: TorchrunProcess
    ckpt_dir: Path
    uploader: ShardUploader | None = None
    leave_event: asyncio.Event = field(default_factory=asyncio.Event)  # set by an MQTT leave
    poll_s: float = 0.02
    leave_wait_s: float = 30.0
    track: PhaseTrack | None = None  # the running (or last) flow's phase

    async def _store(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kw)

    async def run(self, *, deadline: datetime | None = None, reason: str = "spot notice") -> EmergencyOutcome:
        t0 = time.monotonic()
        marks: dict[str, float] = {}

        def mark(name: str) -> None:
            marks[name] = round(time.monotonic() - t0, 4)

        budget = _seconds_until(deadline, default=110.0)
        track = self.track = PhaseTrack(self.node_addr)
        log.warning(
            "emergency_started",
            node_addr=self.node_addr,
            reason=reason,
            budget_s=round(budget, 1),
            phase=str(track.phase),
        )
        lv = _Leaving()
        try:
            await self._checkpoint(lv, t0, budget, reason, mark, track)
            await self._upload_for_leave(lv, deadline, t0, budget, mark, track)
            await self._store(
                self.link.mark_drain_ready,
                self.node_addr,
                keys.DrainReady(step=lv.step, durable=lv.durable, detail=lv.detail),
            )
            mark("drain_ready")
            track.to(Phase.DRAIN_READY, step=lv.step, durable=lv.durable)
            # fleetd answers within a pass when it is up; without it, do not hold the survivors
            # for the whole notice (they re-form by themselves once this node is gone).
            ordered = await self._wait_leave(until=t0 + min(budget, self.leave_wait_s))
            mark("leave")
            if ordered:
                track.to(Phase.LEAVE_ORDERED)
        except StoreLinkError as exc:
            # The store is unreachable: nobody can steer; stop the tree anyway before the deadline.
            lv.detail = f"rendezvous store unreachable: {exc}"
            log.error("emergency_store_unreachable", error=str(exc))
        unsaved = lv.member is not None and lv.step is None
        # No step acknowledged (the world was re-forming all along): SIGTERM, so that a worker
        # saves the step it completed on the way out (agent/trainer/salvage.py), not SIGKILL.
        exit_ = await self.stop_tree(
            salvage_s=min(SALVAGE_S, max(0.0, t0 + budget * 0.7 - time.monotonic())) if unsaved else 0.0
        )
        mark("stopped")
        track.to(Phase.STOPPED, salvage=unsaved, exit_code=exit_.exit_code if exit_ else None)
        if unsaved and self.uploader is not None:
            lv.step, lv.durable, lv.detail = await self._upload_newest_local(
                deadline, t0 + budget * 0.95, mark, lv.detail
            )
            if lv.step is not None:
                track.to(Phase.NEWEST_LOCAL_UPLOADED, step=lv.step, durable=lv.durable)
        try:
            await self._store(
                self.link.mark_left, self.node_addr, keys.Left(exit_code=exit_.exit_code if exit_ else None)
            )
            track.to(Phase.LEFT)
        except StoreLinkError as exc:
            log.warning("emergency_left_unreported", error=str(exc))
        if lv.upload is not None:
            lv.durable, upload_detail = await lv.upload  # the agent outlives the tree: finish the upload
            lv.detail = lv.detail or upload_detail
        log.warning(
            "emergency_done",
            step=lv.step,
            durable=lv.durable,
            timings=marks,
            detail=lv.detail,
            phase=str(track.phase),
        )
        return EmergencyOutcome(lv.step, lv.durable, True, marks, lv.detail, track.phase)

    async def _checkpoint(
        self, lv: _Leaving, t0: float, budget: float, reason: str, mark: Callable[[str], None], track: PhaseTrack
    ) -> None:
        """Steps 1-2: a checkpoint with hold, and the step every rank acknowledged (None: none)."""
        lv.member = await self._store(self.link.member, self.node_addr)
        if lv.member is None:
            lv.detail = "not yet a member of the training world (restoring): nothing to checkpoint"
            log.warning("emergency_not_a_member", node_addr=self.node_addr)
            return
        # First say a notice is under way, so that fleetd re-forms the survivors once for
        # the whole wave rather than once per leaver (DESIGN.md "A wave of notices").
        await self._store(self.link.mark_noticed, self.node_addr, keys.Noticed(reason=reason[:200]))
        lv.seq = await self._store(
            self.link.request_checkpoint, reason, hold=True, leaving=(self.node_addr,), by=self.node_addr
        )
        mark("requested")
        track.to(Phase.CHECKPOINT_REQUESTED, seq=lv.seq)
        # No acknowledgement within half the notice: the wave came while the world re-formed.
        lv.step, lv.held_only = await self._wait_saved(lv.seq, until=t0 + budget * 0.5)
        mark("saved")
        track.to(Phase.NO_ACK if lv.step is None else Phase.ACKED, step=lv.step, held_only=lv.held_only)

    async def _upload_for_leave(
        self,
        lv: _Leaving,
        deadline: datetime | None,
        t0: float,
        budget: float,
        mark: Callable[[str], None],
        track: PhaseTrack,
    ) -> None:
        """Step 3: upload this node's copy of the step, waiting for it only where leaving first
        would lose it."""
        step = lv.step
        if step is None:
            lv.detail = lv.detail or "no checkpoint acknowledged before the deadline; the last durable one stands"
        elif lv.held_only:
            lv.detail = f"left at the hold: the nodes that stay save step {step} (agent/trainer/hold_plan.py)"
        elif not local_ckpt.step_dir(self.ckpt_dir, step).is_dir():
            # A member of an earlier world that dropped out of the one that saved step N (a
            # slow restart): the ranks that acknowledged it hold it, this node has nothing.
            lv.detail = f"this node holds no copy of step {step} (not in the world that saved it)"
        elif self.uploader is not None:
            lv.upload = asyncio.create_task(self._upload(step, deadline, until=t0 + budget * 0.8, mark=mark))
            # Replicated state (DDP): every survivor holds all of step N already, so the node
            # may leave while its copy uploads. Sharded state: the shard must be durable first.
            # And when the whole world is noticed there is no survivor: fleetd terminates a
            # node as soon as it has left, so a copy still uploading then would die with it.
            assert lv.seq is not None  # a step was acknowledged for this request
            if not self._replicated(step) or not await self._store(self._a_survivor_holds, lv.seq, step):
                lv.durable, lv.detail = await lv.upload
                track.to(Phase.UPLOADED, step=step, durable=lv.durable)

    def _a_survivor_holds(self, seq: int, step: int) -> bool:
        """Does a rank that saved ``step`` live on a node that is not itself noticed?"""
        holders = {a.node_addr for a in self.link.acks(seq) if a.step == step and not a.held_only}
        holders -= {self.node_addr, ""}
        return any(self.link.noticed(addr) is None for addr in holders)

    def _every_remaining_rank_acked(self, seq: int, acks: list[keys.CheckpointAck]) -> bool:
        """Every rank of the world acknowledged ``seq``, or the ones that did not run on nodes
        that have already left (a wave: an earlier leaver's ranks never answer a later request,
        and waiting for them would eat half of this node's notice)."""
        world = acks[0].world_size
        missing = set(range(world)) - {a.rank for a in acks}
        if not missing:
            return True
        # Who held each rank: the acks of the newest earlier request answered by this same world
        # (same size, every rank that answered both on the same node).
        here = {a.rank: a.node_addr for a in acks}
        for earlier in range(seq - 1, max(0, seq - 8), -1):
            owner = {a.rank: a.node_addr for a in self.link.acks(earlier) if a.world_size == world}
            if missing <= owner.keys() and all(owner.get(r) == addr for r, addr in here.items()):
                gone = {owner[r] for r in missing}
                return "" not in gone and all(self.link.has_left(addr) for addr in gone)
        return False

    def _replicated(self, step: int) -> bool:
        return local_ckpt.is_complete(local_ckpt.step_dir(self.ckpt_dir, step), "state_dict")

    async def _upload(
        self, step: int, deadline: datetime | None, until: float, mark: Callable[[str], None]
    ) -> tuple[bool, str]:
        assert self.uploader is not None
        try:
            durable = await within(
                self.uploader.upload(step, local_ckpt.step_dir(self.ckpt_dir, step), deadline=deadline),
                max(1.0, until - time.monotonic()),
            )
            return durable, ""
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure: report it, the leave goes on
            log.error("emergency_upload_failed", step=step, error=str(exc))
            return False, f"upload failed: {exc}"
        finally:
            mark("uploaded")

    async def _wait_saved(self, seq: int, until: float) -> tuple[int | None, bool]:
        """The step every rank acknowledged (None: none in time), and whether this node's ranks
        stopped at it without saving: then the nodes that stay save it, and this one need not
        wait for their save (hold_plan.py)."""
        while time.monotonic() < until:
            acks = await self._store(self.link.acks, seq)
            held = [a for a in acks if a.node_addr == self.node_addr and a.held_only]
            if held and len({a.rank for a in held}) >= held[0].local_world_size:
                return held[0].step, True  # every rank here stopped: its tree may go
            if acks and await self._store(self._every_remaining_rank_acked, seq, acks):
                newest: int = max(a.step for a in acks)
                return newest, False
            await asyncio.sleep(self.poll_s)
        acks = await self._store(self.link.acks, seq)
        mine = [a.step for a in acks if a.node_addr == self.node_addr and not a.held_only]
        return (max(mine) if mine else None), False

    async def _wait_leave(self, until: float) -> bool:
        """True when fleetd's leave came (store key or MQTT), False when ``until`` passed first."""
        while time.monotonic() < until and not self.leave_event.is_set():
            if await self._store(self.link.leave_requested, self.node_addr) is not None:
                return True
            await wait_set(self.leave_event, self.poll_s)
        if not self.leave_event.is_set() and time.monotonic() >= until:
            log.warning("emergency_leave_timeout", node_addr=self.node_addr)
        return self.leave_event.is_set()

    async def stop_tree(self, salvage_s: float = 0.0) -> TorchrunExit | None:
        if not self.torchrun.running:
            return None
        if salvage_s > 0:
            return await self.torchrun.stop(timeout_s=salvage_s)
        self.torchrun.kill()
        return await self.torchrun.wait()

    async def _upload_newest_local(
        self, deadline: datetime | None, until: float, mark: Callable[[str], None], detail: str
    ) -> tuple[int | None, bool, str]:
        """No coordinated step: make this node's newest complete local step durable instead (the
        newest any rank saved here: periodic, an earlier request's, or salvaged just now). S3's
        ``latest`` only moves forward, so an older step than the durable one changes nothing."""
        found = [s for m in ("state_dict", "dcp") if (s := local_ckpt.newest_complete(self.ckpt_dir, m)) is not None]
        if not found:
            return None, False, detail
        step = max(found)
        durable, upload_detail = await self._upload(step, deadline, until=until, mark=mark)
        log.warning("emergency_newest_local_uploaded", step=step, durable=durable)
        said = f"no checkpoint acknowledged before the deadline: this node's newest local step {step} uploaded"
        return step, durable, f"{said} ({upload_detail})" if upload_detail else said


SALVAGE_S = 10.0  # SIGTERM to SIGKILL when no step was acknowledged: a worker's save takes < 1 s


def _seconds_until(deadline: datetime | None, default: float) -> float:
    if deadline is None:
        return default
    return max(1.0, (deadline - datetime.now(UTC)).total_seconds() - 5.0)
