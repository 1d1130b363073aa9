"""Folder mode's hooks (``[job] checkpoint_dir``): a script that only saves to a folder, supervised
with no change to its code. ``ElasticHooks`` except: the newest durable version is restored before
torchrun starts and the folder is synced to S3 while it trains (folder_sync.py); a notice or drain
sends ``checkpoint_signal``, waits for the next version to be durable and leaves as the emergency
path does; a store move or restart-trainer asks the script to save, then restarts torchrun on its
own folder. Steps lost are what the script's own checkpointing loses.
(docs/DESIGN.md "Training loops and what each guarantees")
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from agent.hooks import AgentContext
from agent.supervise.elastic_hooks import ElasticHooks
from agent.supervise.emergency import PhaseTrack
from agent.supervise.failure_guard import wait_guarded
from agent.supervise.folder_gate import GATE_ENV, GateConfig
from agent.supervise.folder_sync import FolderSync
from agent.supervise.proctree import process_tree
from agent.supervise.store_watch import log_size
from agent.supervise.torchrun import TorchrunProcess
from agent.supervise.workspace import JobWorkspace
from fleetd.protocol import rendezvous_keys as keys
from fleetd.protocol.interruption import Phase
from fleetd.shared.logs import get_logger

log = get_logger(__name__)
LEAVE_WAIT_S = 30.0  # as the emergency path: fleetd answers within a pass when it is up
# A move to a new store waits this long for the script's save; the store is already gone, and
# training rides through until torchrun is stopped, so this is time on the old world, not lost.
MOVE_SAVE_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class FolderSettings:
    folder: Path
    signal: str = "none"  # "none", "SIGUSR1", "SIGTERM"
    settle_s: float = 2.0

    @classmethod
    def from_job(cls, job: Any, workspace: JobWorkspace | None = None) -> FolderSettings | None:
        if job.checkpoint_dir is None:
            return None
        folder = Path(job.checkpoint_dir)
        if workspace is not None:
            folder = workspace.resolve(folder)  # a job file's relative folder: in the job's code folder
        return cls(folder, job.checkpoint_signal, job.checkpoint_settle_s)

    def gate(self, ckpt_dir: Path) -> GateConfig:
        # Long enough for the slowest node's last save to settle and upload, then one download.
        return GateConfig(
            folder=self.folder,
            state=ckpt_dir / "folder-state.json",
            want=ckpt_dir / "folder-want.json",
            timeout_s=max(60.0, 10 * self.settle_s),
        )


@dataclass
class FolderHooks(ElasticHooks):
    folder: FolderSettings | None = None
    sync: FolderSync | None = None
    client_config: Any = None  # botocore Config for the store (tests: no retries)
    leave_event: asyncio.Event = field(default_factory=asyncio.Event)  # fleetd's MQTT leave
    _store_link: Any = None
    _started: bool = False
    _log_start: int = 0  # torchrun.log's size when this torchrun started

    @classmethod
    def from_context(cls, ctx: AgentContext) -> FolderHooks:
        base = ElasticHooks.from_context(ctx)
        values = {f.name: getattr(base, f.name) for f in fields(ElasticHooks)}
        folder = FolderSettings.from_job(ctx.config.job, base.workspace)
        # The script's workers are forked from the warm pool like the library's: a signal sent to
        # torchrun's children (its warm_launch stand-ins) is relayed to the script.
        spec = base.spec
        if folder is not None:  # torchrun gates each round's workers on one version (folder_gate.py)
            spec = replace(spec, extra_env=(*spec.extra_env, (GATE_ENV, folder.gate(spec.ckpt_dir).model_dump_json())))
        values["spec"] = spec
        return cls(**values, folder=folder)

    async def run(self) -> None:
        from fleetd.protocol.messages import TrainerExited

        assert self.folder is not None, "FolderHooks needs [job] checkpoint_dir"
        if not await self.code_ready():
            return
        async with contextlib.AsyncExitStack() as stack:
            store = None
            if self.checkpoints is not None:
                from agent.checkpoint_store.store import CheckpointStore

                store = await stack.enter_async_context(
                    CheckpointStore.connect(
                        self.checkpoints, self.aws, job=self.spec.job, client_config=self.client_config
                    )
                )
            self.sync = FolderSync(
                self.folder.folder,
                self.spec.ckpt_dir / "folder-staging",
                store,
                self.instance_id,
                settle_s=self.folder.settle_s,
                job_pids=self._job_pids,
                state_path=self.folder.gate(self.spec.ckpt_dir).state,
                want_path=self.folder.gate(self.spec.ckpt_dir).want,
                on_uploaded=self._uploaded,
            )
            if store is not None:
                await self.sync.restore()
            self.restart_requested.clear()
            self._log_start = log_size(self.log_path)
            self.torchrun = TorchrunProcess(self.spec, log_path=self.log_path, sink=self.log_sink).start()
            self.starts += 1
            await self.set_state("training")
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._connect_link())
                syncing = tg.create_task(self.sync.run()) if store is not None else None
                refresh = (
                    tg.create_task(self.sync.refresh_until_started(self._workers_started))
                    if store is not None
                    else None
                )
                exit_ = await self._supervise()
                for task in (syncing, refresh):
                    if task is not None:
                        task.cancel()
            if exit_ is not None and store is not None and exit_.reason == "finished":
                await self._final_version()
        if exit_ is not None:
            await self.publish_event(
                TrainerExited(instance_id=self.instance_id, exit_code=exit_.exit_code, reason=exit_.reason)
            )

    async def _supervise(self) -> Any:
        """torchrun until it exits for good (None: its last exit is reported already). A restart
        asked for while it ran (the leader moved the rendezvous store: ``on_endpoint``; fleetd's
        restart-trainer) starts it again with the current spec; the script resumes from its own
        folder, which stays on this disk, so nothing is restored and the folder sync goes on
        uploading. A failed script is reported at once and waits for fleetd's word: a restart
        while the job has restarts left (fleetd/policy/job_state.py), else the node is released."""
        from fleetd.protocol.messages import TrainerExited

        assert self.torchrun is not None
        while True:
            # A failure of the script itself ends torchrun's own restarts (failure_guard); the
            # log offset is this torchrun's start (the log is shared by every run on the node).
            exit_ = await wait_guarded(self.torchrun, self.log_path, self._log_start, self._may_fail)
            if self.draining or self.stopping:
                return exit_
            if not self.restart_requested.is_set():
                if exit_.reason != "failed":
                    return exit_
                await self.publish_event(
                    TrainerExited(instance_id=self.instance_id, exit_code=exit_.exit_code, reason=exit_.reason)
                )
                await self.set_state("ready")
                await self._wait_restart_or_stop()
                if not self.restart_requested.is_set() or self.draining or self.stopping:
                    return None
            log.warning(
                "trainer_restarting", why=self._restart_why, rdzv=f"{self.spec.rdzv_host}:{self.spec.rdzv_port}"
            )
            self._restart_why = "fleetd asked (restart-trainer)"
            self.restart_requested.clear()
            self._log_start = log_size(self.log_path)
            self.torchrun = TorchrunProcess(self.spec, log_path=self.log_path, sink=self.log_sink).start()
            self.starts += 1
            await self.set_state("training")

    async def _stop_to_move(self) -> None:
        """Before torchrun is stopped for a new store, the script is asked to save (its
        ``checkpoint_signal``, as on a notice) and the agent waits, up to MOVE_SAVE_WAIT_S, for
        that save: the restarted script resumes from it. Without a signal, from its last save."""
        if self.folder is not None and self.folder.signal != "none" and self.sync is not None:
            t0 = time.monotonic()
            version, detail = await self._signal_and_wait(t0, until=t0 + MOVE_SAVE_WAIT_S)
            log.info(
                "folder_saved_before_move", version=version, detail=detail, seconds=round(time.monotonic() - t0, 3)
            )
        await super()._stop_to_move()

    async def _final_version(self) -> None:
        """The script's last save, written just before it exited: wait for it to settle."""
        assert self.sync is not None
        until = time.monotonic() + self.folder.settle_s * 2 + 5 if self.folder else 0
        while time.monotonic() < until and await self.sync.poll() is None:
            await asyncio.sleep(self.sync.poll_s)

    async def _connect_link(self) -> None:
        """Connect to the rendezvous store now, not on the notice: the first connection imports
        torch in this process, which takes seconds of the notice's two minutes on a busy node."""
        try:
            self._store_link = await asyncio.to_thread(self._link().connect)
        except Exception as exc:  # noqa: BLE001 - the drain connects again (and reports) if needed
            log.warning("folder_store_link_failed", error=str(exc))

    async def _uploaded(self, result: Any) -> None:
        await self.publish_event(result.to_event(self.instance_id))

    def _job_pids(self) -> list[int]:
        """torchrun's tree and the warm pool's (where the script's processes were forked)."""
        if self.torchrun is None or self.torchrun.pid is None:
            return []
        roots = [self.torchrun.pid] + ([self.torchrun.pool.pid] if self.torchrun.pool is not None else [])
        return [p.pid for root in roots for p in process_tree(root)]

    def _workers(self) -> list[psutil.Process]:
        """torchrun's own children, one per rank: the script's processes, or with the warm pool
        their warm_launch stand-ins, which relay a signal to the script (torchrun itself was forked
        in the pool, so they are found in its tree). Their children, data loaders, are not
        signalled: a loader killed by an uncaught SIGUSR1 would take its worker down with it."""
        if self.torchrun is None or self.torchrun.pid is None:
            return []
        out = _children(self.torchrun.pid, recursive=False)  # a cold torchrun's (no pool)
        if self.torchrun.pool is not None:
            out += [p for p in _children(self.torchrun.pool.pid, recursive=True) if _is_stand_in(p)]
        return out

    def _workers_started(self) -> bool:
        """torchrun has started its workers once (it does after its first round completes)."""
        if not self._started and self._workers():
            self._started = True
        return self._started

    def _workers_alive(self) -> bool:
        return any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in self._workers())

    async def on_checkpoint_saved(self, report: Any) -> None:
        return None  # folder mode has no trainer reports; the folder sync uploads

    async def _drain(self, *, deadline: datetime | None, reason: str) -> None:
        if self.torchrun is None or self.draining:
            return
        self.draining = True
        await self.set_state("draining")
        t0 = time.monotonic()
        budget = _seconds_until(deadline, default=110.0)
        log.warning(
            "folder_drain_started",
            reason=reason,
            budget_s=round(budget, 1),
            signal=self.folder.signal if self.folder else "none",
        )
        # No coordinated checkpoint in folder mode: NOTICED goes straight to DRAIN_READY.
        track = PhaseTrack(self.spec.node_addr)
        version, detail = await self._signal_and_wait(t0, until=t0 + budget * 0.8)
        link = self._store_link or await asyncio.to_thread(self._link().connect)
        try:
            await asyncio.to_thread(
                link.mark_drain_ready,
                self.spec.node_addr,
                keys.DrainReady(step=version, durable=version is not None, detail=detail),
            )
            track.to(Phase.DRAIN_READY, step=version, durable=version is not None)
            until = t0 + min(budget, LEAVE_WAIT_S)
            ordered = False
            while time.monotonic() < until and not self.leave_event.is_set():
                if await asyncio.to_thread(link.leave_requested, self.spec.node_addr) is not None:
                    ordered = True
                    break
                await asyncio.sleep(0.05)
            if ordered or self.leave_event.is_set():
                track.to(Phase.LEAVE_ORDERED)
        finally:
            exit_ = None
            if self.torchrun.running:
                self.torchrun.kill()
                exit_ = await self.torchrun.wait()
            track.to(Phase.STOPPED, exit_code=exit_.exit_code if exit_ else None)
            await asyncio.to_thread(
                link.mark_left, self.spec.node_addr, keys.Left(exit_code=exit_.exit_code if exit_ else None)
            )
            track.to(Phase.LEFT)
        log.warning("folder_drain_done", version=version, detail=detail, seconds=round(time.monotonic() - t0, 3))
        await self.set_state("leaving")

    async def _signal_and_wait(self, t0: float, until: float) -> tuple[int | None, str]:
        sync = self.sync
        if sync is None or sync.store is None:
            return None, "folder mode without a checkpoint store: nothing uploaded"
        if self.folder is None or self.folder.signal == "none":
            # The script's last save may still be settling (a save every few seconds is never
            # "settled" at the drain's first look): it is uploaded before the node says ready.
            await sync.poll()
            if await sync.pending():
                await sync.wait_new_version(sync.watch.changed_at - 1e-6, until, self._workers_alive)
            kept = sync.last_version or None
            return kept, "folder mode, no signal: the script's last save is what is kept"
        sig = getattr(signal, self.folder.signal)
        for p in self._workers():
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        version = await sync.wait_new_version(t0, until, self._workers_alive)
        if version is None:
            kept = sync.last_version or None
            return kept, f"folder mode: no new save after {self.folder.signal}; the last one stands"
        return version, f"folder mode: saved after {self.folder.signal}"

    async def on_leave(self, command: Any) -> None:
        if self.draining:
            self.leave_event.set()  # the drain stops the tree and says ``left``
            return
        await super().on_leave(command)


def _children(pid: int, *, recursive: bool) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=recursive)
    except psutil.NoSuchProcess:
        return []


def _is_stand_in(proc: psutil.Process) -> bool:
    """A worker's warm_launch, as torchrun started it (the pool's own forks keep the pool's
    command line)."""
    try:
        return "agent.supervise.warm_launch" in proc.cmdline()
    except psutil.Error:
        return False


def _seconds_until(deadline: datetime | None, default: float) -> float:
    if deadline is None:
        return default
    return max(1.0, (deadline - datetime.now(UTC)).total_seconds() - 5.0)
