"""The training-side checkpoint helper a user's script imports (``step`` counts completed steps).

    ckpt = ElasticCheckpointer(model, optimizer)        # reads torchrun's and fleetd's env
    step = ckpt.resume()                                 # newest checkpoint: local, else S3
    while step < total:
        step += 1
        ...train one step...
        ckpt.step_done(step)                             # periodic save, fleetd's requests
(docs/DESIGN.md "Training loops and what each guarantees", "One interruption, end to end")
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

from agent.trainer import hold_plan, local_ckpt, store_view
from agent.trainer.context import TrainerContext
from agent.trainer.local_ckpt import Mode, SavedStep
from agent.trainer.reports import TrainerReports
from agent.trainer.resume import ResumeSteps, collective_device
from agent.trainer.salvage import TermWatcher, UpdateGuard, host_copy

LEFT_GRACE_S = 5.0


class ElasticCheckpointer(ResumeSteps):
    def __init__(
        self,
        model: Any,
        optimizer: Any = None,
        *,
        mode: Mode = "state_dict",
        ctx: TrainerContext | None = None,
        extra_state: dict[str, Any] | None = None,
        stateful: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.mode: Mode = mode
        self.ctx = ctx or TrainerContext.from_env()
        self.extra_state = extra_state if extra_state is not None else {}
        # Objects with state_dict()/load_state_dict() saved beside the model (an LR scheduler, a
        # framework's loop counters): the framework callbacks (agent/trainer/integrations) use it.
        self.stateful = stateful if stateful is not None else {}
        self.root = self.ctx.ckpt_dir
        self.root.mkdir(parents=True, exist_ok=True)
        self.handled_seq = 0
        self.last_saved: int | None = None
        self.held_only_step: int | None = None  # a hold this node leaves at without saving
        self.resumed_from: int | None = None
        self._link = None
        self._view: store_view.StoreView | None = None  # rank 0's look at the store, every step
        self.store_generation = 0
        self._pulse_at = 0.0  # monotonic time of rank 0's last progress bump
        self.reports = TrainerReports(self.ctx)
        # Which step the parameters hold, for a save without collectives after a peer's loss.
        self._guard: UpdateGuard | None = (
            UpdateGuard(optimizer) if hasattr(optimizer, "register_step_post_hook") else None
        )
        self._save_lock = threading.Lock()  # the main thread's save vs. the SIGTERM watcher's
        if self.ctx.steered:
            from agent.trainer.store_link import StoreLink

            assert self.ctx.store_host is not None and self.ctx.store_port is not None  # steered
            self._link = StoreLink(self.ctx.store_host, self.ctx.store_port, self.ctx.run_id).connect()
            self.handled_seq = self._agree_max(self._already_handled() if self.ctx.rank == 0 else 0)
            if self.ctx.rank == 0:
                self._view = store_view.StoreView(self._link, self.emit)
            if self.ctx.local_rank == 0 and self.ctx.node_addr:
                # From now on this node holds training state: a notice must checkpoint it.
                from fleetd.protocol.rendezvous_keys import Member

                self._link.mark_member(self.ctx.node_addr, Member(world_size=self.ctx.world_size))

    @property
    def update_guard(self) -> UpdateGuard | None:
        """Which step the parameters hold (None: the optimizer has no step hooks)."""
        return self._guard

    def _already_handled(self, lookback: int = 16) -> int:
        """The newest request number this worker need not answer.

        Requests the previous workers acknowledged are done. One made while workers restart (a
        joining node asking for a hold checkpoint, typically) has no acknowledgement yet and must
        be answered now, or the joiner gives up waiting and the job loses every step since the
        last periodic save. An unanswered request older than the joiner's wait is stale (its
        requester went on without it), and a leave request whose leavers are all gone protects
        nothing: holding for either would only stall training.
        """
        assert self._link is not None
        seq = self._link.latest_request_seq()
        for _ in range(lookback):
            if seq == 0 or self._link.answered(seq):
                return seq
            request = self._link.request(seq, wait_s=0.5)
            if request is None or _moot(request, self._link):
                return seq
            seq -= 1
        return seq

    # ------------------------------------------------------------------ collectives
    def _dist(self) -> ModuleType | None:
        import torch.distributed as dist

        return dist if dist.is_available() and dist.is_initialized() else None

    def _all_reduce(self, value: int, op: str) -> int:
        dist = self._dist()
        if dist is None:
            return value
        import torch

        t = torch.tensor([value], dtype=torch.int64, device=collective_device(dist))
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        return int(t.item())

    def _agree_max(self, value: int) -> int:
        return self._all_reduce(value, "MAX")

    def _barrier(self) -> None:
        dist = self._dist()
        if dist is not None:
            dist.barrier()

    # ------------------------------------------------------------------ state
    def _plain_state(self) -> dict[str, Any]:
        model = getattr(self.model, "module", self.model)  # unwrap DDP
        state = {"model": model.state_dict(), "extra": dict(self.extra_state)}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        if self.stateful:
            state["stateful"] = {k: v.state_dict() for k, v in self.stateful.items()}
        return state

    def _apply_plain(self, state: dict[str, Any]) -> None:
        model = getattr(self.model, "module", self.model)
        model.load_state_dict(state["model"])
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.extra_state.clear()
        self.extra_state.update(state.get("extra", {}))
        for k, saved in state.get("stateful", {}).items():
            if k in self.stateful:
                self.stateful[k].load_state_dict(saved)

    # ------------------------------------------------------------------ save
    def save(self, step: int, *, world_barrier: bool = True) -> SavedStep | None:
        """Save step ``step`` on every node (collective: call on all ranks at the same step).
        Without ``world_barrier`` (a hold some nodes leave at: hold_plan.py) the ranks wait only
        for their own node's copy; replicated state only."""
        if self.last_saved == step:
            return None
        started = time.monotonic()
        saved: SavedStep | None = None
        if self.mode == "state_dict":
            if self.ctx.local_rank == 0:
                with self._save_lock:
                    saved = local_ckpt.save_plain(self.root, step, self._plain_state())
        else:
            saved = self._save_dcp(step, started)
        if world_barrier:
            self._barrier()  # every node's copy is in place before anyone acks or moves on
        elif self.ctx.local_rank != 0 and not hold_plan.wait_for_local_copy(self.root, step, self.ctx.hold_timeout_s):
            # No ack may claim a copy this node lacks: fail, and torchrun restarts the worker.
            raise RuntimeError(f"local rank 0 wrote no copy of step {step} in {self.ctx.hold_timeout_s:g} s")
        self.last_saved = step
        if saved is not None:
            local_ckpt.prune(self.root, self.ctx.ckpt_keep)
            self.reports.saved(saved)
        self.emit("saved", step=step, duration_s=round(time.monotonic() - started, 4))
        return saved

    def _save_dcp(self, step: int, started: float) -> SavedStep | None:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import save

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer if self.optimizer is not None else [])
        tmp = local_ckpt.dcp_tmp_dir(self.root, step)
        tmp.mkdir(parents=True, exist_ok=True)
        save({"model": model_sd, "optim": optim_sd}, storage_writer=FileSystemWriter(str(tmp)))
        self._barrier()
        if self.ctx.local_rank != 0:
            return None
        return local_ckpt.finish_dcp(self.root, step, started)

    # ------------------------------------------------------------------ every step
    def step_done(self, step: int) -> None:
        """Call on every rank after each completed step (a checkpoint at step N holds the state
        after N steps). All ranks learn a checkpoint request at the same step, save that step and
        ack it; a request with ``hold`` then keeps them from running ahead (``_hold``)."""
        if self._guard is not None:
            self._guard.step_done(step)
        if self._link is not None:
            # Rank 0 reads the store (and survives its outage: agent/trainer/store_view.py); the
            # others learn the newest request, and which store it is in, from the all-reduce.
            seen = self._view.seen(self.handled_seq, self._pulse) if self._view is not None else 0
            generation, agreed = store_view.unpack(self._agree_max(seen))
            if generation != self.store_generation:
                self._new_store(generation)
            if agreed > self.handled_seq:
                self._answer(step, agreed)
                return
        if self.ctx.ckpt_interval and step % self.ctx.ckpt_interval == 0:
            self.save(step)
        self.reports.progress(step)

    def _new_store(self, generation: int) -> None:
        """The rendezvous store restarted empty while this worker trained on: its request numbers
        start again, and this node's member key must be written again (a notice checks it)."""
        self.store_generation, self.handled_seq = generation, 0
        assert self._link is not None
        if self.ctx.rank != 0:
            self._link.drop()  # connect to the new store on the next call
        if self.ctx.local_rank == 0 and self.ctx.node_addr:
            from agent.trainer.store_link import StoreLinkError
            from fleetd.protocol.rendezvous_keys import Member

            try:
                self._link.mark_member(self.ctx.node_addr, Member(world_size=self.ctx.world_size))
            except StoreLinkError as exc:
                self.emit("store_member_unmarked", error=str(exc)[:200])
        self.emit("store_generation", generation=generation)

    def _pulse(self) -> None:
        """Tell fleetd's steering the job advances (rendezvous_keys.progress_key): a node whose
        store heartbeats lag while this goes on is a store blip, not a hung collective."""
        from fleetd.protocol.rendezvous_keys import PROGRESS_EVERY_S

        now = time.monotonic()
        if self._link is not None and now - self._pulse_at >= PROGRESS_EVERY_S:
            self._link.bump_progress()
            self._pulse_at = now

    def _answer(self, step: int, seq: int) -> None:
        assert self._link is not None
        requests = [r for s in range(self.handled_seq + 1, seq + 1) if (r := self._link.request(s)) is not None]
        hold = any(r.hold for r in requests)
        leaving = tuple(a for r in requests for a in r.leaving)
        plan = hold_plan.agreed_plan(self.mode, hold, leaving, self.ctx, self._all_reduce)
        if not plan.save:
            self.held_only_step = step  # this node leaves: the staying nodes' copies carry on
        else:
            self.save(step, world_barrier=plan.world_barrier)
        for s in range(self.handled_seq + 1, seq + 1):
            self._ack(s, step)
        self.handled_seq = seq
        reasons = [r.reason for r in requests]
        self.emit("checkpoint_request", seq=seq, step=step, hold=hold, held_only=not plan.save, reasons=reasons)
        if hold:
            self._hold(step, leaving=leaving, extra_grace_s=plan.extra_grace_s)

    def _ack(self, seq: int, step: int) -> None:
        from fleetd.protocol.rendezvous_keys import CheckpointAck

        assert self._link is not None
        self._link.ack(
            CheckpointAck(
                seq=seq,
                step=step,
                rank=self.ctx.rank,
                world_size=self.ctx.world_size,
                node_addr=self.ctx.node_addr,
                local_dir=str(local_ckpt.step_dir(self.root, step)),
                held_only=self.held_only_step == step,
                local_world_size=self.ctx.local_world_size,
            )
        )

    def _hold(self, step: int, leaving: tuple[str, ...] = (), extra_grace_s: float = 0.0) -> None:
        """Do not run ahead of a checkpoint a leave waits on. Normally the agent's torchrun
        restarts this worker into the next round while it waits here (fleetd pokes it).

        Without fleetd (its steering process down), nobody pokes: once every leaving node has
        stopped and ``LEFT_GRACE_S`` (+ ``extra_grace_s``) passed, the worker fails on purpose so
        torchrun re-forms without the departed node (a failure restart, not a membership one)."""
        assert self._link is not None
        self.emit("hold", step=step, leaving=list(leaving))
        until = time.monotonic() + self.ctx.hold_timeout_s
        all_left_at: float | None = None
        grace_s = LEFT_GRACE_S + extra_grace_s
        while time.monotonic() < until:
            if self._link.released(self.handled_seq):
                self.emit("released", step=step)
                return
            # A node that is itself leaving never re-forms on its own: the steps it would train
            # die with it while its agent uploads the held one (a whole-fleet wave).
            if self.ctx.node_addr in leaving:
                all_left_at = None
            elif leaving and all_left_at is None and all(self._link.has_left(a) for a in leaving):
                all_left_at = time.monotonic()
            if all_left_at is not None and time.monotonic() - all_left_at > grace_s:
                self.emit("hold_abandoned", step=step)
                raise RuntimeError(
                    f"{', '.join(leaving)} left {grace_s:g} s ago and no re-rendezvous came "
                    "(fleetd's steering down?): restarting so torchrun re-forms without them"
                )
            newest = self._link.latest_request_seq()
            if newest > self.handled_seq:  # nothing changed since the save: ack the same step
                for s in range(self.handled_seq + 1, newest + 1):
                    self._ack(s, step)
                    if (r := self._link.request(s)) is not None:
                        leaving = (*leaving, *r.leaving)
                self.handled_seq = newest
            time.sleep(0.05)
        self.emit("hold_timeout", step=step)

    # ------------------------------------------------------------------ a peer lost without notice
    @contextlib.contextmanager
    def salvage_on_failure(self) -> Iterator[None]:
        """Wrap the training loop: if it fails (a peer's collective broke) or torchrun stops the
        worker (SIGTERM while a collective hangs), save the last completed step first."""
        watcher = TermWatcher(self.salvage_before_exit)
        why_not = watcher.arm()
        if why_not is not None:
            self.emit("salvage_on_sigterm_off", why=why_not)
        try:
            yield
        except Exception as exc:
            try:
                self.salvage(f"{type(exc).__name__}: {exc}"[:200])
            except Exception as salvage_exc:  # noqa: BLE001 - never hide the training failure
                self.emit("salvage_failed", error=repr(salvage_exc)[:200])
            raise
        finally:
            watcher.disarm()

    def salvage(self, reason: str, wait_s: float = 5.0, *, last: bool = False) -> SavedStep | None:
        """Save the step the parameters hold on this node's disk, with no collective (the
        process group may be broken). Replicated state only; local rank 0 writes the node's copy.
        Returns None when there is nothing new to save or the state cannot be trusted. ``last``:
        the process exits right after (SIGTERM); no update may follow the save (UpdateGuard)."""
        if self.ctx.local_rank != 0:
            return None
        if self.mode != "state_dict" or self._guard is None:
            why = "sharded state: the lost rank's shard is gone" if self.mode != "state_dict" else "no optimizer"
            self.emit("salvage_skipped", reason=reason, why=why)
            return None
        started = time.monotonic()
        # Hold the update lock through the save: the main thread may still be training.
        with self._guard.consistent(wait_s, keep=last) as (step, ready):
            if step is None:
                self.emit("salvage_skipped", reason=reason, why="parameters mid-update")
                return None
            with self._save_lock:
                newest = local_ckpt.newest_complete(self.root, self.mode)
                if newest is not None and newest >= step:
                    self.emit("salvage_skipped", reason=reason, why=f"step {newest} already saved", step=step)
                    return None
                saved = local_ckpt.save_plain(self.root, step, host_copy(self._plain_state(), ready))
        local_ckpt.prune(self.root, self.ctx.ckpt_keep)
        self.emit("salvaged", step=step, reason=reason, duration_s=round(time.monotonic() - started, 4))
        self.reports.saved(saved)
        self._announce_salvage(step)
        return saved

    def _announce_salvage(self, step: int) -> None:
        """Say in the store that this node holds ``step`` (its agent uploads it next): a world that
        forms without this node waits, bounded, for it rather than resume from an older step
        (resume.py). Best effort, on a connection of its own with a short timeout: the worker may
        be about to exit, and the main thread may hold the per-step link."""
        if not self.ctx.steered or not self.ctx.s3_bucket:
            return
        from agent.trainer.store_link import StoreLink, StoreLinkError
        from fleetd.protocol.rendezvous_keys import Salvaged

        assert self.ctx.store_host is not None and self.ctx.store_port is not None  # steered
        try:
            link = StoreLink(self.ctx.store_host, self.ctx.store_port, self.ctx.run_id, timeout_s=2.0).connect()
            link.announce_salvage(Salvaged(step=step, addr=self.ctx.node_addr or ""))
        except (StoreLinkError, OSError) as exc:
            self.emit("salvage_unannounced", step=step, error=str(exc)[:200])

    def salvage_before_exit(self, reason: str) -> SavedStep | None:
        """The SIGTERM watcher's salvage: the worker exits after it, and its main thread trains
        no further step meanwhile (it would be reported, and lost)."""
        return self.salvage(reason, last=True)

    # ------------------------------------------------------------------ reporting
    def emit(self, event: str, **fields: Any) -> None:
        """One line in the events file (tests and benchmarks read it); no-op without one."""
        self.reports.emit(event, **fields)


# A joining node waits this long for its hold checkpoint (agent/supervise/torchrun_main.py,
# FLEETD_JOIN_CKPT_TIMEOUT_S); an unanswered request older than that has been given up on.
PENDING_REQUEST_MAX_AGE_S = 10.0


def _moot(request: Any, link: Any) -> bool:
    age = (datetime.now(UTC) - request.requested_at).total_seconds()
    if age > PENDING_REQUEST_MAX_AGE_S:
        return True
    return bool(request.leaving) and all(link.has_left(a) for a in request.leaving)
