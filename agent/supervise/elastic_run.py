"""``ElasticHooks.run``, the node's torchrun supervisor, in named steps: one torchrun from its start
to its exit, then what the exit calls for (stop, wait for fleetd, or wait for the store and start
again). ``ElasticHooks`` (agent/supervise/elastic_hooks.py) inherits it; the hooks' other half
(notices, drains, commands) stays there. The fields it reads are ``ElasticHooks``'s own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.node.log_sink import WorkerLogSink
from agent.supervise.failure_guard import wait_guarded
from agent.supervise.job_setup import s3_fetch, until_ready
from agent.supervise.launch import LaunchSpec
from agent.supervise.store_watch import (
    ExitCause,
    StoreProbe,
    classify_exit,
    log_size,
    log_tail,
    probe,
    wait_for_store,
)
from agent.supervise.torchrun import TorchrunExit, TorchrunProcess
from agent.supervise.workspace import JobWorkspace
from fleetd.protocol.messages import NodeState
from fleetd.shared.backoff import Backoff
from fleetd.shared.logs import get_logger
from fleetd.shared.waits import wait_set

log = get_logger(__name__)

# Exits the agent names itself to fleetd: a tree it stopped (a drain's, a leave's) can exit 1, and
# a lost store or a failed rendezvous exits non-zero too; each would read as the job's failure.
OWN_VERDICTS = frozenset({ExitCause.STORE_LOST, ExitCause.RENDEZVOUS_FAILED, ExitCause.STOPPED})


@dataclass
class _Between:
    """What one torchrun hands to the next within a run."""

    crash_backoff: Backoff
    before: StoreProbe  # the store as seen before the next torchrun starts
    ready: TorchrunProcess | None = None  # prewarmed while waiting for the store


class ElasticRun:
    """torchrun supervised for the life of the agent (``run``); mixed into ``ElasticHooks``."""

    # ElasticHooks's fields, as this half uses them.
    spec: LaunchSpec
    instance_id: str
    publish_event: Callable[[Any], Awaitable[None]]
    set_state: Callable[[NodeState], Awaitable[None]]
    aws: Any
    log_path: Path | None
    log_sink: WorkerLogSink | None
    torchrun: TorchrunProcess | None
    draining: bool
    stopping: bool
    healthy_run_s: float
    restart_requested: asyncio.Event
    _stopped: asyncio.Event
    starts: int
    last_exit_cause: ExitCause | None
    _drained: asyncio.Event
    _restart_why: str
    workspace: JobWorkspace | None

    async def code_ready(self) -> bool:
        """The job's code set up on this node before torchrun first starts (job_setup.py)."""
        if self.workspace is None:
            return True

        async def wait_retry() -> None:
            await self.set_state("ready")
            self.restart_requested.clear()
            await self._wait_restart_or_stop()

        fetch = s3_fetch(self.aws)
        ws, iid = self.workspace, self.instance_id
        return await until_ready(
            ws, fetch, instance_id=iid, publish_event=self.publish_event, wait_retry=wait_retry, stopped=self._stopped
        )

    def _probe(self) -> StoreProbe:
        return probe(self.spec.rdzv_host, self.spec.rdzv_port, self.spec.run_id)

    async def run(self) -> None:
        """Supervise torchrun for the life of the agent.

        torchrun restarts its own workers after a lost peer; it exits for good when the store is
        gone (the rendezvous host died or restarted) or training failed past its restarts. The
        first is not the job's fault: start torchrun again, with backoff, once the store answers
        (store_watch). The second is reported and left to fleetd (a restart-trainer command).
        """
        if not await self.code_ready():
            return
        crash_backoff = Backoff(first_s=1.0, max_s=30.0)
        between = _Between(crash_backoff, await asyncio.to_thread(self._probe))
        try:
            while not self.stopping:
                if not await self._one_torchrun(between):
                    return
        finally:
            if between.ready is not None:
                await asyncio.to_thread(between.ready.discard)

    async def _one_torchrun(self, between: _Between) -> bool:
        """Start torchrun, wait for its exit, report it, get ready for the next start. False: the
        run is over (stopped, drained, finished, or stopped while waiting for the store)."""
        since = log_size(self.log_path)
        started = time.monotonic()
        self.restart_requested.clear()
        torchrun = await self._start_torchrun(between)
        if torchrun is None:
            return False
        exit_ = await wait_guarded(torchrun, self.log_path, since, self._may_fail)
        if self.restart_requested.is_set() and not (self.draining or self.stopping):
            log.warning("trainer_restarting", why=self._restart_why)
            self._restart_why = "fleetd asked (restart-trainer)"
            between.before = await asyncio.to_thread(self._probe)
            return True
        cause = await self._exit_cause(exit_, between.before, since)
        ran_s = time.monotonic() - started
        await self._report_exit(exit_, cause, ran_s)
        if cause in (ExitCause.STOPPED, ExitCause.FINISHED):
            return False
        return await self._ready_for_next_start(between, exit_, cause, ran_s)

    async def _start_torchrun(self, between: _Between) -> TorchrunProcess | None:
        """The next torchrun started (the prewarmed one if it still fits); None: draining."""
        if between.ready is not None and between.ready.spec is not self.spec:
            # Prewarmed for a store the leader has since moved away from.
            await asyncio.to_thread(between.ready.discard)
            between.ready = None
        if self.draining:
            # Noticed or drained before this start (a replacement noticed while it
            # restores): starting now would train past the notice, unseen by the wave's
            # checkpoint (a loaded storm run trained alone for 40 s and lost its steps).
            return None
        self.torchrun = (
            between.ready or TorchrunProcess(self.spec, log_path=self.log_path, sink=self.log_sink)
        ).start()
        between.ready = None
        self.starts += 1
        await self.set_state("training")
        return self.torchrun

    async def _exit_cause(self, exit_: TorchrunExit, before: StoreProbe, since: int) -> ExitCause:
        """Why torchrun exited (``last_exit_cause``): stopped by us, or as the store and its log say."""
        if self.draining or self.stopping:
            cause = ExitCause.STOPPED
        else:
            after = await asyncio.to_thread(self._probe)
            cause = classify_exit(exit_, before, after, log_tail(self.log_path, since))
        self.last_exit_cause = cause
        return cause

    async def _report_exit(self, exit_: TorchrunExit, cause: ExitCause, ran_s: float) -> None:
        from fleetd.protocol.messages import TrainerExited

        if self.draining:
            # The notice path stops the tree before its upload ends (replicated state:
            # survivors hold the step). fleetd terminates a node as soon as it reports its
            # trainer exited, so say so only once the upload is done: when every node was
            # noticed there are no survivors, and the upload in flight is the job's only copy.
            await self._drained.wait()
        log.warning(
            "trainer_exited",
            cause=str(cause),
            exit_code=exit_.exit_code,
            ran_s=round(ran_s, 1),
            starts=self.starts,
        )
        await self.publish_event(
            TrainerExited(
                instance_id=self.instance_id,
                exit_code=exit_.exit_code,
                reason=str(cause) if cause in OWN_VERDICTS else exit_.reason,
            )
        )

    async def _ready_for_next_start(
        self, between: _Between, exit_: TorchrunExit, cause: ExitCause, ran_s: float
    ) -> bool:
        """After a failure, fleetd's restart-trainer; after a lost store, the store back (with a
        crash backoff when torchrun ran only briefly). False: stopped while waiting for the store."""
        await self.set_state("ready")
        if cause is ExitCause.FAILED:
            # Training itself broke: do not crash-loop it; fleetd's stall recovery decides.
            log.error("trainer_failed", exit_code=exit_.exit_code, why="waiting for a restart-trainer command")
            await self._wait_restart_or_stop()
            return True
        # The next torchrun's warm pool imports torch while the store is still coming back.
        between.ready = await asyncio.to_thread(
            TorchrunProcess(self.spec, log_path=self.log_path, sink=self.log_sink).prewarm
        )
        if ran_s < self.healthy_run_s:
            # Exited again soon after a restart: the store may be flapping. Slow down.
            await wait_set(self._stopped, between.crash_backoff.next_delay())
        else:
            between.crash_backoff.reset()
        found = await wait_for_store(self._probe, self._stopped)
        if found is None:
            return False
        between.before = found
        why = (
            "the rendezvous store is back" if cause is ExitCause.STORE_LOST else "its rendezvous failed; joining again"
        )
        log.warning("trainer_restarting", why=why, incarnation=found.incarnation)
        return True

    def _may_fail(self) -> bool:
        return not (self.draining or self.stopping or self.restart_requested.is_set())

    async def _wait_restart_or_stop(self) -> None:
        stop = asyncio.ensure_future(self._stopped.wait())
        restart = asyncio.ensure_future(self.restart_requested.wait())
        try:
            await asyncio.wait({stop, restart}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            restart.cancel()
