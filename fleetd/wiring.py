"""The composition root of `fleetd run`: which real components plug into the daemon.

    MQTT (+ SQS) intake ─► node registry ─► reconcile loop (observer)
                                   └──────► training signals (throughput, durable checkpoint)
    reconcile loop ─► commander ─► rendezvous store (checkpoint requests) / MQTT (drain, shutdown)
    steering: reads torchrun's rendezvous state, removes leavers, completes rounds early
    publisher: /metrics and status.json every pass; ledger: every dollar, persisted

A dry run observes and plans only: no ledger writes, no commands, no steering.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fleetd.config import FleetdConfig
from fleetd.daemon import DaemonContext, Plugins
from fleetd.intake.signals import TrainingSignals
from fleetd.intake.wiring import Intake, build_intake
from fleetd.job_watch import JobWatcher
from fleetd.publish import status_component
from fleetd.reconcile.ledger_store import DB_NAME, LedgerStore
from fleetd.rendezvous.client import RendezvousClient
from fleetd.rendezvous.commander import TrainingCommander
from fleetd.rendezvous.silence import SilenceWatch
from fleetd.rendezvous.steer_settings import SteerSettings
from fleetd.rendezvous.steering import Steerer
from fleetd.shared.logs import get_logger
from fleetd.stall_watch import StallWatcher

if TYPE_CHECKING:
    from fleetd.ha.compose import HaParts

log = get_logger(__name__)


def store_address(cfg: FleetdConfig) -> str:
    """Where fleetd reaches the store: the rendezvous host binds ``rendezvous.host`` on this same
    control host, so a wildcard bind is reached over loopback."""
    host = cfg.rendezvous.host
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


async def production_plugins(cfg: FleetdConfig, ctx: DaemonContext, *, dry_run: bool) -> tuple[Plugins, Any]:
    """The plugins and what to close after the daemon (the ledger, or the HA parts)."""
    ha = None
    if cfg.ha.backend == "dynamodb":
        from fleetd.ha.compose import host_id, open_ha

        ha = await open_ha(cfg)
        if dry_run:
            return _ha_dry_run_plugins(cfg, ctx, ha), ha
        log.info("ha_ready", table=cfg.ha.table, holder=ha.election.holder, lease_s=cfg.ha.lease_s)
    client_id = f"fleetd-{cfg.fleet.name}-{host_id(cfg)}"[:64] if ha is not None else None
    intake = build_intake(cfg, wake=ctx.wake_loop, client_id=client_id)
    signals = TrainingSignals(intake.registry, cfg.job.nproc_per_node)
    signals.code_digest = cfg.job.code_digest
    components, sqs_intake = _every_host_components(cfg, intake, ha)
    if dry_run:
        # Stalls are still detected and reported; no recovery action is taken.
        ctx.stall = _dry_run_stall_watcher(cfg, intake)
        components.append(ctx.stall.run)
        return Plugins(components=components, observer=intake.registry, signals=signals), None

    ledger: Any = ha.ledger if ha is not None else await LedgerStore.open(cfg.fleet.state_dir / DB_NAME)
    steerer, commander = _steerer_and_commander(cfg, intake, signals)
    _watch_job_and_stalls(cfg, ctx, intake, signals, steerer, ledger)
    ctx.job.resume = commander.resume_job
    leader_only = _leader_components(cfg, ctx, intake, signals, steerer, commander, ha, sqs_intake)
    if ha is None and cfg.fleet.state_backup_interval_s > 0:
        # One control host: its SQLite file is the state's only copy (DynamoDB keeps its own).
        from fleetd.state_backup import StateBackup

        components.append(StateBackup(cfg, cfg.fleet.state_backup_interval_s).run)
    plugins = Plugins(
        components=components,
        leader_components=leader_only,
        observer=intake.registry,
        signals=signals,
        commander=commander,
        ledger=ledger,
        ha=ha,
    )
    return plugins, ha if ha is not None else ledger


def _dry_run_stall_watcher(cfg: FleetdConfig, intake: Intake) -> StallWatcher:
    """Detects and reports stalls, takes no recovery action (no commands, no steering)."""
    return StallWatcher(
        cfg.stall.settings(),
        intake.registry,
        state_dir=cfg.fleet.state_dir,
        dry_run=True,
        store_addr=(store_address(cfg), cfg.rendezvous.port),
    )


def _ha_dry_run_plugins(cfg: FleetdConfig, ctx: DaemonContext, ha: HaParts) -> Plugins:
    """A dry run beside an HA pair: it plans from the shared state; what it records stays in its
    own memory."""
    from fleetd.reconcile.state_dynamo import DynamoStateStore

    private = DynamoStateStore(ha.state.table, ha.election, persist=False)
    intake = build_intake(cfg, wake=ctx.wake_loop)
    ctx.stall = _dry_run_stall_watcher(cfg, intake)
    return Plugins(
        components=[*intake.components(), status_component(), ctx.stall.run],
        observer=intake.registry,
        signals=TrainingSignals(intake.registry, cfg.job.nproc_per_node),
        state=private,
    )


def _every_host_components(cfg: FleetdConfig, intake: Intake, ha: HaParts | None) -> tuple[list[Any], list[Any]]:
    """What runs on every control host (leader or standby), and the SQS intake among the intake's
    components (with HA, only the leader runs it)."""
    components: list[Any] = [*intake.components(), status_component()]
    if cfg.enrol.enabled:
        from fleetd.identity.server import enrolment_component

        components.append(enrolment_component(cfg))
    sqs_intake = [c for c in components if getattr(c, "__name__", "") == "_run_sqs"]
    if ha is not None:
        # SQS hands a message to one consumer: a standby reading the queue would take the
        # leader's notices. Only the leader consumes it (a standby's MQTT intake is harmless:
        # every subscriber gets its own copy, so it stays warm).
        components = [c for c in components if c not in sqs_intake]
    return components, sqs_intake


def _steerer_and_commander(
    cfg: FleetdConfig, intake: Intake, signals: TrainingSignals
) -> tuple[Steerer, TrainingCommander]:
    """The rendezvous side: steering reads torchrun's rounds, the commander acts on them."""
    client = RendezvousClient(store_address(cfg), cfg.rendezvous.port, cfg.rendezvous.run_id)
    steerer = Steerer(
        client,
        SteerSettings(
            min_nodes=1,
            max_nodes=cfg.fleet.max_nodes,
            dead_after_s=cfg.loss.dead_after_s,
            hang_after_s=cfg.loss.hang_after_s,
        ),
        on_heartbeat=intake.registry.note_store_heartbeat,
        silence=SilenceWatch(cfg.loss.silent_after_s, intake.registry.broker_seen_at),
        known_addr=intake.registry.knows_addr,
    )
    commander = TrainingCommander(
        client,
        intake.mqtt.send_command,
        intake.registry,
        signals,
        close_rendezvous=steerer.close_rendezvous,
        reopen_rendezvous=steerer.reopen_rendezvous,
    )
    steerer.on_leave = commander.tell_leave
    return steerer, commander


def _watch_job_and_stalls(
    cfg: FleetdConfig, ctx: DaemonContext, intake: Intake, signals: TrainingSignals, steerer: Steerer, ledger: Any
) -> None:
    """The job's lifecycle and stall recovery, both acting (commands, steering): ``ctx.job``, ``ctx.stall``."""
    ctx.job = JobWatcher(
        cfg.job.lifecycle_settings(),
        intake.registry,
        signals,
        state_dir=cfg.fleet.state_dir,
        total_steps=cfg.job.total_steps,
        code_digest=cfg.job.code_digest,
        send_command=intake.mqtt.send_command,
        steerer=steerer,
        wake=ctx.wake_loop,
        ledger=ledger,
    )
    ctx.stall = StallWatcher(
        cfg.stall.settings(),
        intake.registry,
        send_command=intake.mqtt.send_command,
        steerer=steerer,
        state_dir=cfg.fleet.state_dir,
        store_addr=(store_address(cfg), cfg.rendezvous.port),
        job_active=ctx.job.job_active,
    )


def _leader_components(
    cfg: FleetdConfig,
    ctx: DaemonContext,
    intake: Intake,
    signals: TrainingSignals,
    steerer: Steerer,
    commander: TrainingCommander,
    ha: HaParts | None,
    sqs_intake: list[Any],
) -> list[Any]:
    """What only the leading control host runs (all of it, on a single host). Needs ``ctx.job``
    and ``ctx.stall`` set (_watch_job_and_stalls)."""

    async def steering(ctx: DaemonContext) -> None:
        # The store lives in its own process (fleetd rendezvous): the loop connects when it
        # answers and rides through its outages (Steerer.run), never failing on it.
        await steerer.run(ctx.stopping)

    from fleetd.jobs.submission import submission_component

    leader_only = [
        steering,
        commander.run,
        ctx.stall.run,
        ctx.job.run,
        submission_component(cfg, ctx, signals),
        *(sqs_intake if ha is not None else []),
    ]
    if ha is not None:
        from fleetd.ha.compose import host_id
        from fleetd.ha.endpoint import endpoint_publisher

        leader_only.append(endpoint_publisher(cfg, host_id(cfg), ha.election, ha.state, intake.mqtt.publish_retained))
    return leader_only
