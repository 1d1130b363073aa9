"""`fleet-agent run`: the agent's components under one asyncio.TaskGroup.

    IMDS watcher ──notice──> MQTT events (QoS 1, at once) ──> controller
                 └─────────> hooks.on_notice (emergency path, local, not waiting for anyone)
    trainer channel ──progress──> telemetry (QoS 0, ~1 Hz)
                    └─checkpoint saved──> MQTT event + hooks.on_checkpoint_saved
    MQTT commands ──> hooks.on_checkpoint / on_drain / on_leave / on_shutdown

The emergency path and torchrun supervision sit behind ``agent.hooks.NodeHooks``; this module is
the composition that picks them (``agent.supervise.elastic_hooks`` for a node that trains,
``LoggingHooks`` otherwise). SIGTERM/SIGINT give a bounded clean shutdown: hooks stop,
queued events are delivered, the retained status says offline.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from agent import __version__
from agent.config import AgentConfig
from agent.hooks import AgentContext, HooksFactory, LoggingHooks, NodeHooks
from agent.node.deadman import ControllerWatch, run_shutdown_command
from agent.node.enrol import NodeEnrolment, enrol_and_renew, enrolment_for
from agent.node.imds import Identity, ImdsClient, SpotSignal, SpotWatcher, read_identity
from agent.node.journal import JournalWriter
from agent.node.last_bound import CANCEL_GRACE_S, exit_unless_done
from agent.node.log_batcher import LogBatcher, LogShipper
from agent.node.log_sink import WorkerLogSink
from agent.node.mqtt_session import MqttSession
from agent.node.notice_repeat import repeat_notice
from agent.node.outbox import Outbox
from agent.node.telemetry import TelemetryLoop
from agent.node.trainer_channel import TrainerChannel
from agent.supervise.elastic_hooks import ElasticHooks
from agent.supervise.folder_hooks import FolderHooks
from fleetd.protocol.messages import (
    CheckpointCommand,
    CheckpointSaved,
    DrainCommand,
    LeaveCommand,
    Message,
    Notice,
    Rebalance,
    RendezvousEndpoint,
    RestartTrainerCommand,
    ShutdownCommand,
)
from fleetd.protocol.trainer import CheckpointSavedLocally
from fleetd.shared.aws_region import region_of_zone
from fleetd.shared.logs import bind_context, get_logger
from fleetd.shared.sdnotify import Heartbeat, Notifier, watchdog
from fleetd.shared.settings import MqttConfig

log = get_logger(__name__)


def default_hooks_factory(config: AgentConfig) -> HooksFactory:
    """The composition: a node that trains gets torchrun supervision and the emergency path;
    one that does not (``node.supervise_training = false``) logs what it would do."""
    if not config.node.supervise_training:
        return LoggingHooks
    # Folder mode: a script that only saves to a folder (agent/supervise/folder_hooks.py).
    return FolderHooks.from_context if config.job.checkpoint_dir is not None else ElasticHooks.from_context


@dataclass(frozen=True)
class _NodeParts:
    """What runs beside the MQTT session, built once the node's identity is known."""

    trainer: TrainerChannel
    shipper: LogShipper
    hooks: NodeHooks
    watcher: SpotWatcher
    telemetry: TelemetryLoop
    controller: ControllerWatch


class Agent:
    def __init__(self, config: AgentConfig, hooks_factory: HooksFactory | None = None) -> None:
        self.config = config
        self.hooks_factory = hooks_factory or default_hooks_factory(config)
        # Read (and removed from os.environ) before torchrun is spawned: children must not inherit it.
        self.notifier = Notifier.from_environment()
        self._stop = asyncio.Event()
        self._commands: asyncio.Queue[Message | RendezvousEndpoint] = asyncio.Queue()
        self._tg: asyncio.TaskGroup | None = None
        # Hooks started by _spawn and not finished yet: cancelled with the components at the end
        # of the bounded shutdown, or one waiting on a trainer that is gone keeps the TaskGroup
        # (and the agent process) alive for ever.
        self._spawned: set[asyncio.Task[None]] = set()
        self.identity: Identity | None = None
        self.session: MqttSession | None = None
        self.hooks: NodeHooks | None = None
        self.watcher: SpotWatcher | None = None
        self.shipper: LogShipper | None = None

    def request_stop(self) -> None:
        if not self._stop.is_set():
            log.info("agent_stop_requested")
        self._stop.set()

    async def run(self) -> None:
        node = self.config.node
        async with ImdsClient(node.imds_url, token_ttl_s=node.imds_token_ttl_s, timeout_s=node.imds_timeout_s) as imds:
            identity = await self._unless_stopped(read_identity(imds))
            if identity is None:
                return
            self._adopt_identity(identity)
            # Enrolment runs beside the IMDS watcher, never before it: a node waiting for its
            # certificate (the controller not up yet) still sees its notice and is READY for
            # systemd at once, so the boot (cloud-final) does not wait on the controller.
            enrolment, mqtt_cfg, identity_ready = enrolment_for(
                node.enrol_url, node.state_dir, self.config.mqtt, imds, identity.instance_id
            )
            outbox = Outbox(node.state_dir / "outbox.jsonl")
            await outbox.open()
            session = self.session = self._mqtt_session(identity, mqtt_cfg, outbox, identity_ready)
            session.state = "ready"
            parts = self._node_parts(imds, identity, session)
            log.info("agent_started", version=__version__)
            await self._run_parts(parts, session, enrolment, identity_ready)
        log.info("agent_stopped")

    def _adopt_identity(self, identity: Identity) -> None:
        """The node's identity into the logs; its region when the config names none."""
        self.identity = identity
        bind_context(fleet=self.config.node.fleet, instance_id=identity.instance_id)
        if not self.config.aws.region:
            # No region in the config or the environment: the node's own (S3 calls need one).
            region = region_of_zone(identity.zone)
            aws = self.config.aws.with_region(region, "instance (IMDS zone)")
            self.config = self.config.model_copy(update={"aws": aws})
        log.info("aws_region", region=self.config.aws.region, source=self.config.aws.region_source)

    def _mqtt_session(
        self, identity: Identity, mqtt_cfg: MqttConfig, outbox: Outbox, identity_ready: asyncio.Event | None
    ) -> MqttSession:
        node = self.config.node
        return MqttSession(
            mqtt_cfg,
            fleet=node.fleet,
            instance_id=identity.instance_id,
            outbox=outbox,
            on_command=self._commands.put,
            on_endpoint=self._commands.put,  # the leader's store endpoint, in order with commands
            identity_ready=identity_ready,
            status_fields={
                "agent_version": __version__,
                "instance_type": identity.instance_type,
                "zone": identity.zone,
                "lifecycle": identity.lifecycle,
                "node_addr": node.node_addr or identity.local_ipv4,
                "code_digest": self.config.job.code_digest,
            },
        )

    def _node_parts(self, imds: ImdsClient, identity: Identity, session: MqttSession) -> _NodeParts:
        """The components beside the MQTT session, the hooks among them (``self.hooks``)."""
        node = self.config.node
        trainer = TrainerChannel(node.trainer_socket, self._checkpoint_saved)
        # The workers' output: journald on the node (when it has one), batches to the control host.
        batcher = LogBatcher(job=self.config.job.name, instance_id=identity.instance_id)
        worker_logs = WorkerLogSink(
            self.config.job.name, identity.instance_id, journal=JournalWriter.open(), batcher=batcher
        )
        shipper = self.shipper = LogShipper(batcher, session.publish_logs, session.connected.is_set)
        ctx = AgentContext(
            config=self.config,
            identity=identity,
            publish_event=session.publish_event,
            set_state=session.set_state,
            trainer_progress=trainer.progress,
            request_stop=self.request_stop,
            worker_logs=worker_logs,
        )
        hooks = self.hooks = self.hooks_factory(ctx)
        watcher = self.watcher = SpotWatcher(imds, self._on_spot_signal, interval_s=node.poll_interval_s)
        telemetry = TelemetryLoop(
            identity.instance_id, session.publish_telemetry, trainer.progress, interval_s=node.telemetry_interval_s
        )
        controller = ControllerWatch(
            node.controller_lost_after_s,
            broker_up=session.connected.is_set,
            store_up=self._store_answers,
            on_lost=self._controller_lost,
        )
        return _NodeParts(trainer, shipper, hooks, watcher, telemetry, controller)

    async def _run_parts(
        self,
        parts: _NodeParts,
        session: MqttSession,
        enrolment: NodeEnrolment | None,
        identity_ready: asyncio.Event | None,
    ) -> None:
        """Every component under one TaskGroup until a stop is asked for, then the bounded shutdown."""
        hooks = parts.hooks
        bounds: list[threading.Timer] = []  # the shutdown's last bounds (exit_unless_done)
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tasks = self._start_components(tg, parts, session, enrolment, identity_ready)
                self.notifier.ready("watching IMDS")
                await self._stop.wait()
                # _shutdown is bounded by its own timeout; this covers a cancellation swallowed in it.
                bounds.append(exit_unless_done(self.config.node.shutdown_timeout_s + CANCEL_GRACE_S, tasks))
                await self._shutdown(hooks, session)
                self._cancel_all(tasks)
                bounds.append(exit_unless_done(CANCEL_GRACE_S, [*tasks, *self._spawned]))
        finally:
            for bound in bounds:
                bound.cancel()
            self._tg = None

    def _start_components(
        self,
        tg: asyncio.TaskGroup,
        parts: _NodeParts,
        session: MqttSession,
        enrolment: NodeEnrolment | None,
        identity_ready: asyncio.Event | None,
    ) -> list[asyncio.Task[Any]]:
        watcher = parts.watcher
        return [
            tg.create_task(session.run(), name="mqtt"),
            tg.create_task(watcher.run(), name="imds-watcher"),
            tg.create_task(parts.telemetry.run(), name="telemetry"),
            tg.create_task(parts.trainer.run(), name="trainer-channel"),
            tg.create_task(self._guarded("log-shipper", parts.shipper.run), name="log-shipper"),
            tg.create_task(self._dispatch_commands(), name="commands"),
            tg.create_task(self._guarded("hooks.run", parts.hooks.run), name="hooks"),
            tg.create_task(self._guarded("controller-watch", parts.controller.run), name="controller-watch"),
            *(
                [
                    tg.create_task(
                        self._guarded("enrolment", enrol_and_renew, enrolment, identity_ready), name="enrolment"
                    )
                ]
                if enrolment is not None and identity_ready is not None
                else []
            ),
            # systemd pings only while the IMDS watcher keeps polling (a stuck one would miss a notice).
            tg.create_task(watchdog(self.notifier, Heartbeat.following(lambda: watcher.polls, 10.0)), name="watchdog"),
        ]

    def _store_answers(self) -> bool:
        from agent.supervise.store_watch import probe

        r = self.config.rendezvous
        # The store torchrun follows now (a failover moves it to the new leader's host).
        spec = getattr(self.hooks, "spec", None)
        host, port = (spec.rdzv_host, spec.rdzv_port) if spec is not None else (r.host, r.port)
        return probe(host, port, r.run_id).reachable

    async def _controller_lost(self, reason: str) -> None:
        """Dead man's switch: checkpoint to S3, power the instance off, stop the agent."""
        assert self.hooks is not None
        try:
            step = await self.hooks.on_controller_lost(reason)
        except Exception:  # noqa: BLE001 - the node must power off even if the upload failed
            log.exception("controller_lost_checkpoint_failed")
            step = None
        log.error("powering_off", reason=reason, durable_step=step, command=list(self.config.node.shutdown_command))
        await run_shutdown_command(self.config.node.shutdown_command)
        self.request_stop()

    async def _unless_stopped(self, coro: Coroutine[Any, Any, Any]) -> Any:
        work = asyncio.ensure_future(coro)
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (work, stopped):
                if not t.done():
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await t
        return work.result() if work.done() and not work.cancelled() else None

    async def _shutdown(self, hooks: NodeHooks, session: MqttSession) -> None:
        timeout = self.config.node.shutdown_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            async with asyncio.timeout(timeout):
                # Leave a few seconds of the budget for the goodbye on MQTT.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.1, timeout - 5.0)):
                        await self._guarded("hooks.stop", hooks.stop)
                        if self.shipper is not None:  # the workers' last lines, before the goodbye
                            await self._guarded("log-flush", self.shipper.flush)
                await session.close(timeout_s=max(0.1, deadline - loop.time()))
        except TimeoutError:
            log.warning("agent_shutdown_timeout", timeout_s=timeout)

    async def _guarded(self, name: str, hook: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run a hook; its bugs are logged, never allowed to take the IMDS watcher down with it."""
        try:
            await hook(*args)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("hook_failed", hook=name)

    def _cancel_all(self, components: list[asyncio.Task[Any]]) -> None:
        """The end of the bounded shutdown: every component and every hook still running."""
        for task in [*components, *self._spawned]:
            task.cancel()

    def _spawn(self, name: str, hook: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Start a hook as its own task in the agent's TaskGroup (never awaited by the caller)."""
        if self._tg is not None:
            task = self._tg.create_task(self._guarded(name, hook, *args), name=name)
            self._spawned.add(task)
            task.add_done_callback(self._spawned.discard)

    async def _on_spot_signal(self, sig: SpotSignal) -> None:
        assert self.identity is not None and self.session is not None and self.hooks is not None
        iid = self.identity.instance_id
        if sig.action is not None:
            notice = Notice(instance_id=iid, action=sig.action.action, action_time=sig.action.time, source="imds")
            # Publish first (held in the outbox until acknowledged), then act without waiting.
            await self.session.publish_event(notice)
            self._spawn("hooks.on_notice", self._notice_then_power_off, self.hooks, notice)
            self._spawn("notice-repeat", repeat_notice, self.session.publish_event, notice, self._stop)
        if sig.rebalance is not None:
            rebalance = Rebalance(instance_id=iid, notice_time=sig.rebalance.notice_time, source="imds")
            await self.session.publish_event(rebalance)
            self._spawn("hooks.on_rebalance", self.hooks.on_rebalance, rebalance)

    async def _notice_then_power_off(self, hooks: NodeHooks, notice: Notice) -> None:
        """The notice flow (checkpoint, upload, leave), then, on a terminate notice and with
        ``node.power_off_after_notice``, the instance-initiated shutdown: the node has left and its
        step is durable, so every second until AWS's own termination is billed for nothing. A flow
        that raised powers nothing off (AWS reclaims the node at the notice's time anyway)."""
        await hooks.on_notice(notice)
        if notice.action != "terminate" or not self.config.node.power_off_after_notice:
            return
        command = list(self.config.node.shutdown_command)
        log.warning(
            "powering_off", reason="left on a spot notice", action_time=str(notice.action_time), command=command
        )
        await run_shutdown_command(command)

    async def _checkpoint_saved(self, report: CheckpointSavedLocally) -> None:
        assert self.identity is not None and self.session is not None and self.hooks is not None
        await self.session.publish_event(
            CheckpointSaved(
                instance_id=self.identity.instance_id,
                step=report.step,
                world_size=report.world_size,
                nbytes=report.nbytes,
                duration_s=report.duration_s,
            )
        )
        self._spawn("hooks.on_checkpoint_saved", self.hooks.on_checkpoint_saved, report)

    async def _dispatch_commands(self) -> None:
        while True:
            command = await self._commands.get()
            hooks = self.hooks
            assert hooks is not None
            if isinstance(command, CheckpointCommand):
                self._spawn("hooks.on_checkpoint", hooks.on_checkpoint, command)
            elif isinstance(command, DrainCommand):
                self._spawn("hooks.on_drain", hooks.on_drain, command)
            elif isinstance(command, LeaveCommand):
                self._spawn("hooks.on_leave", hooks.on_leave, command)
            elif isinstance(command, ShutdownCommand):
                self._spawn("hooks.on_shutdown", self._shutdown_command, hooks, command)
            elif isinstance(command, RestartTrainerCommand):
                self._spawn("hooks.on_restart_trainer", hooks.on_restart_trainer, command)
            elif isinstance(command, RendezvousEndpoint):
                self._spawn("hooks.on_endpoint", hooks.on_endpoint, command)

    async def _shutdown_command(self, hooks: NodeHooks, command: ShutdownCommand) -> None:
        try:
            await hooks.on_shutdown(command)
        finally:
            self.request_stop()


async def run_agent(config: AgentConfig, hooks_factory: HooksFactory | None = None) -> None:
    """Run until SIGTERM/SIGINT (or a shutdown command), then stop cleanly within the timeout."""
    agent = Agent(config, hooks_factory)
    loop = asyncio.get_running_loop()

    def stop() -> None:
        agent.notifier.stopping("checkpoint, upload, leave")
        agent.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    try:
        await agent.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
