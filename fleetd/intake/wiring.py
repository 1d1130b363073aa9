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
from fleetd.protocol.logs import get_logger
from fleetd.protocol.topics import fleet_filter

log = get_logger(__name__)

Component = Callable[[Any], Coroutine[Any, Any, None]]  # fleetd.daemon.Component: async def (ctx) -> None


@dataclass
class Intake:
    cfg: FleetdConfig = field(repr=False)
    registry: NodeRegistry
    mqtt: MqttIntake
    # Telemetry on a connection of its own: at 2,000 agents it is 2,000 messages a second, and
    # on one connection a notice waited behind every queued sample (bench/agents_load.py).
    telemetry: MqttIntake | None = None

    def components(self) -> list[Component]:
        """TaskGroup components for the daemon: the MQTT intake, and SQS when a queue is set."""
        out: list[Component] = [self._run_mqtt]
        if self.telemetry is not None:
            out.append(self._run_telemetry)
        if self.cfg.events.sqs_queue_url:
            out.append(self._run_sqs)
        else:
            log.info("intake_sqs_disabled", why="events.sqs_queue_url is not set")
        return out

    async def _run_mqtt(self, ctx: Any) -> None:
        await self.mqtt.run()

    async def _run_telemetry(self, ctx: Any) -> None:
        assert self.telemetry is not None
        await self.telemetry.run()

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
    registry = NodeRegistry(wake=wake)
    fleet = cfg.fleet.name
    telemetry = fleet_filter(fleet, "telemetry")
    main = MqttIntake(
        cfg.mqtt,
        fleet,
        registry,
        subscriptions=(fleet_filter(fleet, "status"), fleet_filter(fleet, "events")),
        unsubscribe=(telemetry,),
        client_id=client_id,
    )  # an older build's session may hold it
    # Its own connection (and, with several control hosts, its own id per host: one id on two
    # hosts would have the broker kick each off in turn).
    tele_id = f"{client_id}-telemetry"[:64] if client_id else f"fleetd-{fleet}-telemetry"
    return Intake(
        cfg, registry, main, MqttIntake(cfg.mqtt, fleet, registry, subscriptions=(telemetry,), client_id=tele_id)
    )
