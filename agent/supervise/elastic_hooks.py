"""The agent's hooks for a node that trains: torchrun supervised, notices and drains run through the
emergency path, periodic checkpoints uploaded to S3. The agent (``agent.main``) composes them in
through the ``agent.hooks.NodeHooks`` interface; nothing here imports the agent's top."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from agent.hooks import AgentContext
from agent.supervise.emergency import CheckpointStoreUploader, EmergencyFlow, EmergencyOutcome
from agent.supervise.launch import LaunchSpec
from agent.supervise.torchrun import TorchrunProcess
from agent.trainer import local_ckpt
from agent.trainer.store_link import StoreLink
from fleetd.protocol import rendezvous_keys as keys
from fleetd.protocol.logs import get_logger

log = get_logger(__name__)


@dataclass
class ElasticHooks:
    """``agent.hooks.NodeHooks``: supervise torchrun and run the emergency path."""

    spec: LaunchSpec
    instance_id: str
    publish_event: Callable[[Any], Awaitable[None]]
    set_state: Callable[[str], Awaitable[None]]
    checkpoints: Any = None  # fleetd.protocol.settings.CheckpointConfig
    aws: Any = None
    log_path: Path | None = None
    torchrun: TorchrunProcess | None = None
    flow: EmergencyFlow | None = None
    draining: bool = False
    _preload: asyncio.Task | None = None
    _drained: asyncio.Event = field(default_factory=asyncio.Event)  # the notice path has finished

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
        )

    def _link(self) -> StoreLink:
        return StoreLink(self.spec.rdzv_host, self.spec.rdzv_port, self.spec.run_id)

    async def run(self) -> None:
        from fleetd.protocol.messages import TrainerExited

        self.torchrun = TorchrunProcess(self.spec, log_path=self.log_path).start()
        await self.set_state("training")
        # The notice path reaches the rendezvous store through torch's TCPStore. Importing torch
        # takes seconds (over 20 s measured on the loaded 2-core demo box), which used to be spent
        # after the notice, eating the checkpoint's share of it: import it in the background, once
        # torchrun's own start-up (which imports torch in every worker) is past.
        self._preload = asyncio.create_task(_preload_store_client_later(PRELOAD_AFTER_S), name="preload-torch")
        exit_ = await self.torchrun.wait()
        if self.draining:
            # The notice path stops the tree before its upload ends (replicated state: survivors
            # hold the step). fleetd terminates a node as soon as it reports its trainer exited,
            # so say so only once the upload is done: when every node was noticed there are no
            # survivors, and the upload in flight is the job's only copy of the step.
            await self._drained.wait()
        await self.publish_event(
            TrainerExited(instance_id=self.instance_id, exit_code=exit_.exit_code, reason=exit_.reason)
        )

    async def _with_store(self, body: Callable[[Any], Awaitable[Any]]) -> Any:
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
        if self.torchrun is None or self.draining:
            return  # not training, or already leaving (notice and drain both arrived)
        self.draining = True
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

                uploader = (CheckpointStoreUploader(store, self.instance_id, on_uploaded=uploaded)
                            if store is not None else None)
                self.flow = EmergencyFlow(link, self.spec.node_addr, self.torchrun, self.spec.ckpt_dir, uploader)
                return await self.flow.run(deadline=deadline, reason=reason)

            await self._with_store(body)
        finally:
            self._drained.set()  # also when the path failed: run() must not wait forever
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
                report.step, files, writer=self.instance_id, root=Path(report.path), step_files=step_files,
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

    async def on_shutdown(self, command: Any) -> None:
        await self.stop()

    async def stop(self) -> None:
        if self.torchrun is not None and self.torchrun.running:
            await self.torchrun.stop(timeout_s=10.0)


PRELOAD_AFTER_S = 20.0


async def _preload_store_client_later(delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    await asyncio.to_thread(_preload_store_client)


def _preload_store_client() -> None:
    import torch.distributed  # noqa: F401  (cached in sys.modules for StoreLink.connect)
