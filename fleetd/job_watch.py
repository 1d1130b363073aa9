"""The job watcher: the thin I/O around fleetd/policy/job_state.py.

    node registry (trainer exits, notices, status)  ─┐
    last reconcile pass (billed nodes, best step)    ├─► job_state.advance ─► job.json, status,
    cancel.json (fleetd cancel), store restarts      ┘     log line, restart-trainer, planner's
                                                            desired_job (END releases every node)

It never takes the controller down: a bad cancel file is logged and ignored.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetd.job_record import JobView, clear_cancel, read_cancel, read_job, record_of, view_of, write_job
from fleetd.localnet import raise_if_cancelled
from fleetd.policy.job_state import (
    JobDecision,
    JobNode,
    JobObservation,
    JobRecord,
    JobSettings,
    JobState,
    NodeExit,
    advance,
    desired_job,
)
from fleetd.policy.ledger_events import JobStateChanged
from fleetd.policy.model import NodePhase
from fleetd.policy.observation import DesiredJob
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

BILLED_EC2_STATES = ("pending", "running")
STORE_KEY = "job"  # the job's record in the state store's meta table
GONE_EC2_STATES = ("shutting-down", "terminated", "stopping", "stopped")


@dataclass
class JobWatcher:
    settings: JobSettings
    registry: Any  # fleetd.intake.registry.NodeRegistry
    signals: Any  # fleetd.intake.signals.TrainingSignals: the planner reads desired_job there
    state_dir: Path | None = None
    total_steps: int | None = None
    send_command: Callable[[Any], Awaitable[None]] | None = None
    steerer: Any = None  # store_restarted_at explains a failure
    wake: Callable[[], None] = lambda: None
    interval_s: float = 1.0
    clock: Callable[[], float] = time.time
    record: JobRecord = field(default_factory=JobRecord)
    code_digest: str = ""  # the job's code version new nodes get (status and report show it)
    ledger: Any = None  # fleetd/reconcile/ports.py LedgerSink: each state change is recorded there too
    # NodeCommander.resume_job: a new run undoes the last run's stop (its rendezvous, closed for
    # good at the stop, takes nodes again; the next stop runs its checkpoint again).
    resume: Callable[[str], Awaitable[None]] | None = None
    _persisted: JobView | None = None
    _store: Any = None  # the reconciler's state store (fleetd/reconcile/state_port.py), once open

    @property
    def view(self) -> JobView:
        return view_of(self.record, self.code_digest)

    def load(self) -> None:
        if self.state_dir is None:
            return
        try:
            found = read_job(self.state_dir)
        except Exception as exc:  # noqa: BLE001 - a bad file must not stop the job's lifecycle
            log.error("job_record_unreadable", error=str(exc))
            return
        if found is not None:
            self._adopt(found, "job.json")

    def _adopt(self, found: JobView, source: str) -> None:
        """Continue the job a file or the state store remembers, unless it ended and the code to
        run now is another version: that is a new run of the job (a resubmitted job file)."""
        if found.terminal and self.code_digest and found.code_digest and found.code_digest != self.code_digest:
            log.warning(
                "job_new_version", ended=str(found.state), old=found.code_digest[:12], new=self.code_digest[:12]
            )
            return
        self.record = record_of(found)
        log.info("job_record_loaded", source=source, state=str(found.state), restarts=found.restarts)

    async def _sync_with_store(self, ctx: Any) -> None:
        """Once the reconciler's state store is open: read the job it remembers. It is shared by
        every controller of an HA pair, so a new leader continues the job where the last one left
        it, not where its own host's job.json did. A newer record there wins."""
        state = getattr(getattr(ctx, "reconciler", None), "state", None)
        if state is None or self._store is not None:
            return
        self._store = state
        try:
            raw = await state.get_meta(STORE_KEY)
            found = JobView.model_validate(raw) if raw else None
        except Exception as exc:  # noqa: BLE001 - a bad record must not stop the job's lifecycle
            log.error("job_record_unreadable", source="state store", error=str(exc)[:300])
            return
        if found is not None and (found.since or 0.0) >= (self.record.since or 0.0):
            self._adopt(found, "state store")

    async def _persist(self, view: JobView) -> None:
        if self.state_dir is not None:
            await asyncio.to_thread(write_job, self.state_dir, view)
        if self._store is not None:
            await self._store.set_meta(STORE_KEY, view.model_dump(mode="json"))

    async def _to_ledger(self, now: float) -> None:
        """The state change as a ledger event (its id: state and since, so a leader that takes
        over and sees the same change again stores it once)."""
        if self.ledger is None:
            return
        rec = self.record
        event = JobStateChanged(
            at=now,
            state=str(rec.state),
            reason=rec.reason[:300],
            restarts=rec.restarts,
            step=rec.final_step,
            code_digest=self.code_digest,
            event_id=f"job-state:{rec.state}:{(rec.since or now):.3f}",
        )
        try:
            await self.ledger.append(event)
        except Exception as exc:  # noqa: BLE001 - the job's lifecycle goes on; job.json and the store have it
            log.error("job_state_ledger_failed", error=repr(exc)[:300])

    def read_cancel(self) -> str | None:
        """The operator's cancel reason, if `fleetd cancel` asked (blocking: call it in a thread)."""
        if self.state_dir is None:
            return None
        try:
            request = read_cancel(self.state_dir)
        except Exception as exc:  # noqa: BLE001 - logged; the job goes on
            log.error("cancel_request_unreadable", error=str(exc))
            return None
        return request.reason if request is not None else None

    def observe(self, ctx: Any, now: float, cancel: str | None = None) -> JobObservation:
        report = getattr(ctx, "last_report", None)
        observation = getattr(report, "observation", None)
        nodes: list[JobNode] = []
        best: int | None = None
        for n in observation.nodes if observation is not None else ():
            rec = self.registry.record(n.instance_id)
            status = rec.status if rec is not None else None
            gone = n.phase is NodePhase.TERMINATED or n.ec2_state in GONE_EC2_STATES
            lost_at = ((rec.ec2_state_at if rec is not None else None) or now) if gone else None
            nodes.append(
                JobNode(
                    instance_id=n.instance_id,
                    billed=n.ec2_state in BILLED_EC2_STATES,
                    training=status is not None and status.state == "training",
                    noticed_at=n.notice_at,
                    leaving=n.phase in (NodePhase.DRAINING, NodePhase.LEAVING) or n.drain_started_at is not None,
                    lost_at=lost_at,
                )
            )
            if n.step is not None:
                best = max(best or 0, n.step)
        exits = tuple(
            NodeExit(r.instance_id, r.exit_at, r.exit_reason, r.exit_code)
            for r in self.registry.records()
            if r.exit_at is not None
        )
        durable = self.signals.durable_step
        if not self.settings.reports_steps:
            best = durable = None  # folder mode: checkpoint numbers count saves, not steps
        elif durable is not None:
            best = max(best or 0, durable)
        return JobObservation(
            now=now,
            nodes=tuple(nodes),
            exits=exits,
            best_step=best,
            durable_step=durable,
            total_steps=self.total_steps,
            cancel_requested=cancel,
            store_restarted_at=getattr(self.steerer, "store_restarted_at", None),
        )

    async def tick(self, ctx: Any) -> JobDecision:
        await self._sync_with_store(ctx)
        now = self.clock()
        cancel = await asyncio.to_thread(self.read_cancel) if not self.record.terminal else None
        obs = self.observe(ctx, now, cancel)
        decision = advance(self.record, obs, self.settings)
        self.record = rec = decision.record
        if decision.changed:
            log_fn = log.error if rec.state == "failed" else log.warning if rec.terminal else log.info
            log_fn("job_state", state=str(rec.state), reason=rec.reason, restarts=rec.restarts, step=rec.final_step)
            await self._to_ledger(now)
        view = view_of(rec, self.code_digest)
        if view != self._persisted:  # a state change, or a restart counted within one
            await self._persist(view)
            self._persisted = view
        for iid in decision.restart:
            log.warning("job_restart_trainer", instance_id=iid, reason=rec.reason, restarts=rec.restarts)
            if self.send_command is not None:
                from fleetd.protocol.messages import RestartTrainerCommand

                await self.send_command(RestartTrainerCommand(instance_id=iid, reason=rec.reason[:200]))
        wanted = desired_job(rec, obs.durable_step, now, self.settings)
        if wanted is not self.signals.desired_job:
            log.warning("job_release", desired=str(wanted), state=str(rec.state))
            self.signals.desired_job = wanted
            self.wake()
        return decision

    async def new_version(self, code_digest: str, settings: JobSettings, total_steps: int | None) -> None:
        """The job's code changed while fleetd runs (fleetd/jobs/submission.py). A job that is
        still going keeps its state and restarts (the planner moves its nodes to the version); one
        that ended starts a new run: PENDING, no restart used, and a cancel or a stop of the last
        run forgotten. Exits seen before count for the old run only."""
        old = self.code_digest
        self.code_digest, self.settings, self.total_steps = code_digest, settings, total_steps
        if not self.record.terminal:
            log.warning("job_new_version", state=str(self.record.state), old=old[:12], new=code_digest[:12])
            return
        seen = frozenset((r.instance_id, r.exit_at) for r in self.registry.records() if r.exit_at is not None)
        ended = self.record.state
        self.record = JobRecord(state=JobState.PENDING, since=self.clock(), counted=seen)
        if self.state_dir is not None:
            await asyncio.to_thread(clear_cancel, self.state_dir)
        if self._store is not None:
            await self._store.set_meta("stop_issued_at", None)
        self.signals.desired_job = DesiredJob.RUN
        if self.resume is not None:
            try:
                await self.resume(f"a new run of the job (code {code_digest[:12]})")
            except Exception as exc:  # noqa: BLE001 - the store may be restarting; its steering reopens it then
                log.warning("job_new_run_rendezvous_not_reopened", error=repr(exc)[:300])
        log.warning("job_new_run", ended=str(ended), old=old[:12], new=code_digest[:12])
        await self._to_ledger(self.clock())
        self.wake()

    def job_active(self) -> bool:
        """The stall watcher's question: should a step be coming?"""
        return not self.record.terminal

    async def run(self, ctx: Any) -> None:
        self.load()
        while True:
            try:
                await self.tick(ctx)
            except Exception as exc:  # noqa: BLE001 - never take the controller (and its budget) down
                log.error("job_watch_failed", error=repr(exc), exc_info=exc)
            await asyncio.sleep(self.interval_s)
            raise_if_cancelled()
