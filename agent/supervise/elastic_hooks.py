"""The agent's hooks for a node that trains: torchrun supervised, notices and drains run through the
emergency path, periodic checkpoints uploaded to S3. The agent (``agent.main``) composes them in
through the ``agent.hooks.NodeHooks`` interface; nothing here imports the agent's top."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from agent.hooks import AgentContext
from agent.node.log_sink import WorkerLogSink
from agent.supervise.elastic_run import ElasticRun
from agent.supervise.emergency import CheckpointStoreUploader, EmergencyFlow, EmergencyOutcome
from agent.supervise.endpoint_follow import FollowAction, StoreEndpoint, follow
from agent.supervise.launch import LaunchSpec
from agent.supervise.store_watch import ExitCause
from agent.supervise.torchrun import TorchrunProcess
from agent.supervise.workspace import JobWorkspace
from agent.trainer import local_ckpt
from agent.trainer.store_link import StoreLink
from fleetd.protocol import rendezvous_keys as keys
from fleetd.protocol.messages import NodeState
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

_T = TypeVar("_T")


@dataclass
class ElasticHooks(ElasticRun):
    """``agent.hooks.NodeHooks``: supervise torchrun (``run``: agent/supervise/elastic_run.py) and run
    the emergency path."""

    spec: LaunchSpec
    instance_id: str
    publish_event: Callable[[Any], Awaitable[None]]
    set_state: Callable[[NodeState], Awaitable[None]]
    checkpoints: Any = None  # fleetd.shared.settings.CheckpointConfig
    aws: Any = None
    log_path: Path | None = None
    log_sink: WorkerLogSink | None = None  # journald and the control host (agent/node/log_sink.py)
    torchrun: TorchrunProcess | None = None
    flow: EmergencyFlow | None = None
    draining: bool = False
    stopping: bool = False  # shutdown, controller lost: never start torchrun again
    # A torchrun that ran this long before the store went away is "healthy": the next restart
    # waits for the store only, not for a crash-loop backoff.
    healthy_run_s: float = 30.0
    restart_requested: asyncio.Event = field(default_factory=asyncio.Event)
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)
    starts: int = 0
    last_exit_cause: ExitCause | None = None
    _drained: asyncio.Event = field(default_factory=asyncio.Event)  # the notice path has finished
    # The store torchrun follows; its generation is None until a leader advertised one.
    endpoint: StoreEndpoint | None = None
    endpoint_restarts: int = 0
    _restart_why: str = "fleetd asked (restart-trainer)"
    workspace: JobWorkspace | None = None  # the job's code, when the controller ships it

    @classmethod
    def from_context(cls, ctx: AgentContext) -> ElasticHooks:
        cfg = ctx.config
        addr = cfg.node.node_addr or ctx.identity.local_ipv4
        return cls(
            spec=LaunchSpec.from_config(cfg, addr),
            instance_id=ctx.identity.instance_id,
            publish_event=ctx.publish_event,
            set_state=ctx.set_state,
            checkpoints=cfg.checkpoints,
            aws=cfg.aws,
            log_path=cfg.node.state_dir / "torchrun.log",
            workspace=JobWorkspace.from_config(cfg),
            log_sink=ctx.worker_logs,
        )

    def _link(self) -> StoreLink:
        return StoreLink(self.spec.rdzv_host, self.spec.rdzv_port, self.spec.run_id)

    async def on_restart_trainer(self, command: Any) -> None:
        """fleetd saw training stalled: start torchrun again if it is not running (a running one
        is restarted, which re-forms the rendezvous)."""
        if self.draining or self.stopping:
            return
        log.warning("trainer_restart_requested", reason=command.reason)
        self.restart_requested.set()  # first: the run loop must start it again, not return
        if self.torchrun is not None and self.torchrun.running:
            # SIGTERM, not SIGKILL: hung workers save the step they completed on the way out.
            await self.torchrun.stop(timeout_s=25.0)

    async def on_endpoint(self, advertised: Any) -> None:
        """The leading controller advertised its rendezvous store (fleetd/ha/endpoint.py). A new
        one (after a failover) moves torchrun to it by the store-restart path: SIGTERM (workers
        save the step they completed), then the run loop starts torchrun against the new
        address, and the trainer resumes from the newest step a local copy or S3 holds."""
        current = self.endpoint or StoreEndpoint(self.spec.rdzv_host, self.spec.rdzv_port)
        decision = follow(current, advertised, self.spec.run_id)
        self.endpoint = decision.endpoint
        if decision.action is not FollowAction.RESTART:
            log.info(
                "rendezvous_endpoint_seen",
                action=str(decision.action),
                host=advertised.host,
                port=advertised.port,
                generation=advertised.generation,
                run_id=advertised.run_id,
            )
            return
        old = f"{self.spec.rdzv_host}:{self.spec.rdzv_port}"
        # Decided and recorded before any await: a second delivery of the same message is STALE.
        self.spec = dataclasses.replace(self.spec, rdzv_host=decision.endpoint.host, rdzv_port=decision.endpoint.port)
        self.endpoint_restarts += 1
        log.warning(
            "rendezvous_endpoint_moved",
            old=old,
            new=f"{decision.endpoint.host}:{decision.endpoint.port}",
            generation=advertised.generation,
            leader=advertised.leader,
        )
        if self.draining or self.stopping:
            return
        self._restart_why = "the leader advertised a new rendezvous store"
        self.restart_requested.set()  # the run loop starts torchrun again (or leaves its wait)
        if self.torchrun is not None and self.torchrun.running:
            await self._stop_to_move()

    async def _stop_to_move(self) -> None:
        """Stop torchrun so that the run loop starts it against the new store. SIGTERM: the
        workers save the step they completed on the way out."""
        assert self.torchrun is not None
        await self.torchrun.stop(timeout_s=25.0)

    async def _with_store(self, body: Callable[[Any], Awaitable[_T]]) -> _T:
        if self.checkpoints is None:
            return await body(None)
        from agent.checkpoint_store.store import CheckpointStore

        async with CheckpointStore.connect(self.checkpoints, self.aws, job=self.spec.job) as store:
            return await body(store)

    async def on_notice(self, notice: Any) -> None:
        await self._drain(deadline=notice.action_time, reason=f"spot notice ({notice.action})")

    async def on_drain(self, command: Any) -> None:
        await self._drain(deadline=command.deadline, reason=command.reason)

    async def _drain(self, *, deadline: datetime | None, reason: str) -> None:
        if self.draining:
            return  # already leaving (notice and drain both arrived)
        self.draining = True  # from here on the run loop starts no torchrun
        if self.torchrun is None:
            await self._leave_before_training(reason)
            return
        try:
            t0 = time.monotonic()
            await self.set_state("draining")
            log.info("drain_prepare", phase="status", after_s=round(time.monotonic() - t0, 3))
            link = await asyncio.to_thread(self._link().connect)
            log.info("drain_prepare", phase="store_link", after_s=round(time.monotonic() - t0, 3))

            async def body(store: Any) -> EmergencyOutcome:
                log.info("drain_prepare", phase="checkpoint_store", after_s=round(time.monotonic() - t0, 3))

                async def uploaded(result: Any) -> None:
                    await self.publish_event(result.to_event(self.instance_id))

                uploader = (
                    CheckpointStoreUploader(store, self.instance_id, on_uploaded=uploaded)
                    if store is not None
                    else None
                )
                assert self.torchrun is not None  # checked before the drain began; never reset
                self.flow = EmergencyFlow(link, self.spec.node_addr, self.torchrun, self.spec.ckpt_dir, uploader)
                return await self.flow.run(deadline=deadline, reason=reason)

            await self._with_store(body)
        finally:
            self._drained.set()  # also when the path failed: run() must not wait forever
        await self.set_state("leaving")

    async def _leave_before_training(self, reason: str) -> None:
        """Drained before torchrun ever started: no training state, nothing to checkpoint or
        upload, no rendezvous to leave. Say so (fleetd ends the node once it is leaving)."""
        log.warning("drain_before_training", reason=reason, why="torchrun not started: nothing to save")
        self._drained.set()
        await self.set_state("draining")
        await self.set_state("leaving")

    async def on_rebalance(self, rebalance: Any) -> None:
        log.info("rebalance_recommendation", notice_time=rebalance.notice_time.isoformat())

    async def on_checkpoint_saved(self, report: Any) -> None:
        """Periodic checkpoints go to S3 too, so a node lost without notice costs at most one
        interval (the survivors resume from the newest copy they hold; a newcomer from S3)."""
        if self.checkpoints is None or self.draining:
            return  # while draining, the emergency path uploads the step that matters

        async def body(store: Any) -> None:
            files, step_files = await asyncio.to_thread(local_ckpt.upload_set, Path(report.path))
            result = await store.upload_step(
                report.step,
                files,
                writer=self.instance_id,
                root=Path(report.path),
                step_files=step_files,
            )
            await self.publish_event(result.to_event(self.instance_id))

        await self._with_store(body)

    async def on_checkpoint(self, command: Any) -> None:
        link = await asyncio.to_thread(self._link().connect)
        await asyncio.to_thread(link.request_checkpoint, command.reason, by=self.instance_id)

    async def on_leave(self, command: Any) -> None:
        if self.flow is not None:
            self.flow.leave_event.set()
            return
        if self.torchrun is not None and self.torchrun.running:
            self.torchrun.kill()
            await self.torchrun.wait()
            link = await asyncio.to_thread(self._link().connect)
            await asyncio.to_thread(link.mark_left, self.spec.node_addr, keys.Left())

    async def on_controller_lost(self, reason: str) -> int | None:
        """Dead man's switch (agent/node/deadman.py): the control host is gone. Stop torchrun for
        good (SIGTERM: its workers save the step they completed, agent/trainer/salvage.py), then
        make this node's newest local checkpoint durable in S3 so that a controller that comes
        back resumes the job from it. Returns the step uploaded (None: nothing to upload)."""
        self.stopping = True
        self._stopped.set()
        if self.torchrun is not None and self.torchrun.running:
            await self.torchrun.stop(timeout_s=25.0)  # under torchrun's own 30 s SIGTERM grace
        root = self.spec.ckpt_dir
        found = [s for m in ("state_dict", "dcp") if (s := local_ckpt.newest_complete(root, m)) is not None]
        if not found:
            log.error("controller_lost_no_checkpoint", reason=reason, why="no complete local step to upload")
            return None
        step = max(found)

        async def body(store: Any) -> int | None:
            if store is None:
                log.error("controller_lost_no_bucket", step=step, why="no checkpoint bucket configured")
                return None
            directory = local_ckpt.step_dir(root, step)
            files, step_files = await asyncio.to_thread(local_ckpt.upload_set, directory)
            result = await store.upload_step(
                step, files, writer=self.instance_id, root=directory, step_files=step_files
            )
            await self.publish_event(result.to_event(self.instance_id))  # queued in the outbox
            log.warning("controller_lost_checkpoint_durable", step=step, complete=result.complete)
            return step

        return await self._with_store(body)

    async def on_shutdown(self, command: Any) -> None:
        await self.stop()

    async def stop(self) -> None:
        self.stopping = True
        self._stopped.set()
        if self.torchrun is not None and self.torchrun.running:
            await self.torchrun.stop(timeout_s=10.0)
