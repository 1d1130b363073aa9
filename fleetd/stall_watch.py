"""The stall watcher: a daemon component that feeds fleetd/policy/stall.py what fleetd sees and
carries out the recovery it picks. The decision is pure; this is the thin I/O around it.

    node registry (agent status, telemetry steps) ─┐
    last reconcile pass (which nodes are billed)   ├─► policy.stall.assess ─► log line, status,
    steering (store reachable, store restarted)    ┘      metrics, stalls.json, recovery action

Recovery actions: ``restart trainers`` sends ``restart-trainer`` over MQTT to the nodes; ``re-form``
makes the steering poke every torchrun into a new round; ``replace nodes`` terminates them in
EC2 through the reconciler (the planner buys replacements as capacity, which resume from S3).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fleetd.localnet import port_answers, raise_if_cancelled
from fleetd.policy.stall import (
    NodeProgress,
    Recovery,
    RecoveryAction,
    StallDecision,
    StallObservation,
    StallSettings,
    StallTracker,
    assess,
)
from fleetd.shared.logs import get_logger
from fleetd.stall_record import StallView, closed_before, read_stalls, view, write_stalls

log = get_logger(__name__)

PROBE_TIMEOUT_S = 1.0
BILLED_EC2_STATES = ("pending", "running")


@dataclass
class StallWatcher:
    settings: StallSettings
    registry: Any  # fleetd.intake.registry.NodeRegistry
    send_command: Callable[[Any], Awaitable[None]] | None = None
    steerer: Any = None  # fleetd.rendezvous.steering.Steerer: when it saw the store restart
    store_addr: tuple[str, int] | None = None  # probed each tick (None: store state unknown)
    state_dir: Any = None
    interval_s: float = 2.0
    clock: Callable[[], float] = time.time
    tracker: StallTracker = field(default_factory=StallTracker)
    dry_run: bool = False  # detect and report, act on nothing
    before: StallView | None = None  # what earlier lives of the daemon recorded
    latest: StallView | None = None
    job_active: Callable[[], bool] = lambda: True  # False once the job is over (fleetd/job_watch.py)

    def load(self) -> None:
        """Carry the stalls of an earlier daemon life over; a stall open then goes on being
        measured from its start."""
        if self.state_dir is None:
            return
        try:
            record = read_stalls(self.state_dir)
        except Exception as exc:  # noqa: BLE001 - a bad record must not stop stall detection
            log.error("stall_record_unreadable", error=str(exc))
            return
        self.before = closed_before(record)
        if record is not None and record.current is not None:
            self.tracker = StallTracker(advanced_at=record.current.since)
        self.latest = view(self.tracker, before=self.before, stall_after_s=self.settings.stall_after_s)

    def observe(self, ctx: Any, now: float, store_reachable: bool | None = None) -> StallObservation:
        report = getattr(ctx, "last_report", None)
        observation = getattr(report, "observation", None)
        nodes: list[NodeProgress] = []
        for n in observation.nodes if observation is not None else ():
            rec = self.registry.record(n.instance_id)
            status = rec.status if rec is not None else None
            tel = rec.telemetry if rec is not None else None
            running = None if status is None or status.state == "offline" else status.state == "training"
            nodes.append(
                NodeProgress(
                    instance_id=n.instance_id,
                    billed=n.ec2_state in BILLED_EC2_STATES and not n.leaving,
                    trainer_running=running,
                    step=tel.step if tel is not None else n.step,
                    telemetry_at=rec.telemetry_at if rec is not None else None,
                )
            )
        restarted_at = self.steerer.store_restarted_at if self.steerer is not None else None
        changed_at = getattr(self.steerer, "rendezvous_changed_at", None)
        forming = bool(getattr(self.steerer, "rendezvous_forming", False))
        stopping = observation is not None and observation.stop_issued_at is not None
        return StallObservation(
            now=now,
            nodes=tuple(nodes),
            store_reachable=store_reachable,
            store_restarted_at=restarted_at,
            training_expected=not stopping and self.job_active(),
            rendezvous_changed_at=changed_at,
            rendezvous_forming=forming,
        )

    async def tick(self, ctx: Any) -> StallDecision:
        reachable = None if self.store_addr is None else await port_answers(*self.store_addr, PROBE_TIMEOUT_S)
        now = self.clock()
        obs = self.observe(ctx, now, reachable)
        decision = assess(self.tracker, obs, self.settings)
        self.tracker = decision.tracker
        ep = decision.tracker.episode
        if decision.detected and ep is not None:
            log.error(
                "job_stalled",
                cause=str(ep.cause),
                no_step_for_s=round(now - ep.since, 1),
                billed_nodes=ep.billed_nodes,
                step=self.tracker.best_step,
                bound_s=self.settings.stall_after_s,
                action=str(decision.actions[0].kind) if decision.actions else "wait",
            )
        elif decision.cause_changed and ep is not None:
            log.warning("job_stall_cause", cause=str(ep.cause), no_step_for_s=round(now - ep.since, 1))
        if decision.ended is not None:
            e = decision.ended
            log.warning(
                "job_stall_ended",
                cause=str(e.cause),
                stalled_s=round(e.duration_s or 0, 1),
                recovery_s=round(e.recovery_s or 0, 1),
                node_seconds=round(e.node_seconds, 1),
                actions=[str(k) for k, _ in e.actions],
                step=self.tracker.best_step,
            )
        for action in decision.actions:
            await self.apply(ctx, action)
        latest = view(self.tracker, before=self.before, stall_after_s=self.settings.stall_after_s)
        changed = (
            self.latest is None
            or latest.model_dump(exclude={"current"}) != self.latest.model_dump(exclude={"current"})
            or latest.stalled
        )
        self.latest = latest
        if changed and self.state_dir is not None:
            await asyncio.to_thread(write_stalls, self.state_dir, latest)
        return decision

    async def apply(self, ctx: Any, action: RecoveryAction) -> None:
        log.warning(
            "stall_recovery",
            action=str(action.kind),
            nodes=list(action.instance_ids),
            reason=action.reason,
            dry_run=self.dry_run,
        )
        if self.dry_run:
            return
        try:
            if action.kind is Recovery.RESTART_TRAINERS and self.send_command is not None:
                from fleetd.protocol.messages import RestartTrainerCommand

                for iid in action.instance_ids:
                    await self.send_command(RestartTrainerCommand(instance_id=iid, reason=action.reason))
            elif action.kind is Recovery.REFORM and self.steerer is not None:
                await self.steerer.reform(action.reason)
            elif action.kind is Recovery.REPLACE_NODES and getattr(ctx, "reconciler", None) is not None:
                await ctx.reconciler.terminate(action.instance_ids, action.reason, self.clock())
        except Exception as exc:  # noqa: BLE001 - a failed rung is logged; the next one comes later
            log.error("stall_recovery_failed", action=str(action.kind), error=repr(exc))

    async def run(self, ctx: Any) -> None:
        self.load()
        while True:
            await asyncio.sleep(self.interval_s)
            raise_if_cancelled()
            try:
                await self.tick(ctx)
            except Exception as exc:  # noqa: BLE001 - never take the controller (and its budget) down
                log.error("stall_watch_failed", error=repr(exc), exc_info=exc)
