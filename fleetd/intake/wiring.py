"""Plugging the intake into ``fleetd run``: one registry, the MQTT intake, the SQS consumer.

    ctx = DaemonContext(cfg)
    intake = build_intake(cfg, wake=ctx.wake_loop)
    await run_daemon(cfg, planner=..., ctx=ctx,
                     plugins=Plugins(components=intake.components(), observer=intake.registry))

``intake.mqtt.send_command`` is how the controller reaches an agent (QoS 1 on its command topic).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from fleetd.config import FleetdConfig
from fleetd.intake import sqs
from fleetd.intake.mqtt import MqttIntake
from fleetd.intake.registry import NodeRegistry
from fleetd.joblogs.store import WorkerLogStore
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

Component = Callable[[Any], Coroutine[Any, Any, None]]  # fleetd.daemon.Component: async def (ctx) -> None


@dataclass
class Intake:
    cfg: FleetdConfig = field(repr=False)
    registry: NodeRegistry
    mqtt: MqttIntake
    logs: WorkerLogStore | None = None

    def components(self) -> list[Component]:
        """TaskGroup components for the daemon: the MQTT intake, the writer of the workers' logs,
        and SQS when a queue is set."""
        out: list[Component] = [self._run_mqtt]
        if self.logs is not None:
            out.append(self._run_logs)
        if self.cfg.events.sqs_queue_url:
            out.append(self._run_sqs)
        else:
            log.info("intake_sqs_disabled", why="events.sqs_queue_url is not set")
        return out

    async def _run_mqtt(self, ctx: Any) -> None:
        await self.mqtt.run()

    async def _run_logs(self, ctx: Any) -> None:
        assert self.logs is not None
        await self.logs.run()

    async def _run_sqs(self, ctx: Any) -> None:
        ev = self.cfg.events
        assert ev.sqs_queue_url is not None
        await sqs.run(
            self.cfg.aws,
            ev.sqs_queue_url,
            self.registry,
            unknown_grace_s=ev.unknown_instance_grace_s,
            unknown_retry_s=ev.unknown_retry_s,
        )


def build_intake(cfg: FleetdConfig, wake: Callable[[], None] | None = None, client_id: str | None = None) -> Intake:
    """``client_id``: the broker session's name; with HA each control host needs its own (two
    clients with one id would take the session from each other in turn)."""
    # One connection for status, events and telemetry. With the deployed broker's TLS identity
    # (use_username_as_clientid) every connection made with the controller's certificate gets the
    # certificate's name as client id, so a second connection (telemetry had one) took the session
    # from the first on every connect, in turn, for as long as both ran. A notice does not wait
    # behind telemetry on the shared connection: the inbox (coalesce.py) hands every event out
    # ahead of the waiting samples, and keeps one sample per node.
    registry = NodeRegistry(wake=wake)
    logs = WorkerLogStore(cfg.fleet.state_dir, job=cfg.job.name)
    mqtt = MqttIntake(cfg.mqtt, cfg.fleet.name, registry, client_id=client_id, on_logs=logs.accept)
    return Intake(cfg, registry, mqtt, logs)
