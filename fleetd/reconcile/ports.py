"""What the reconcile loop needs from the rest of fleetd, as small interfaces.

Other components plug in here: the MQTT/SQS intake provides :class:`NodeObserver` (its node
registry), the training side provides :class:`SignalSource`, the
rendezvous/checkpoint side provides :class:`NodeCommander`, the budget ledger provides
:class:`SpendSource`. The spend source is required (spend is the ledger's bills, never an
estimate); the others have a do-nothing default so the loop runs (and is tested) alone, and the
simulator can drive the same loop with fakes and a virtual clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from fleetd.policy.model import Node
from fleetd.policy.observation import DesiredJob
from fleetd.shared.logs import get_logger

if TYPE_CHECKING:
    from fleetd.config import FleetdConfig
    from fleetd.policy.observation import Observation

log = get_logger(__name__)

Clock = Callable[[], float]  # seconds; time.time in the daemon, a virtual clock in tests/sim


class NodeObserver(Protocol):
    """Folds what the intakes (MQTT, EventBridge/SQS) learned about a node into the planner's
    Node: last_seen_at, agent_offline_at, notice_at, rebalance_at, telemetry.
    fleetd.intake.registry.NodeRegistry implements it."""

    def track(self, instance_id: str) -> None:
        """``instance_id`` belongs to this fleet (EventBridge events for it are ours)."""
        ...

    def observe(self, node: Node) -> Node: ...


@dataclass(frozen=True, slots=True)
class FleetSignals:
    """Fleet-wide facts from the training side (telemetry aggregates, checkpoint store)."""

    throughput_by_nodes: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))
    last_durable_checkpoint_step: int | None = None
    last_durable_checkpoint_at: float | None = None
    last_checkpoint_request_at: float | None = None
    desired_job: DesiredJob = DesiredJob.RUN
    code_digest: str = ""  # the job's code version now (Observation.code_digest)
    stop_completed_at: float | None = None  # the stop sequence ended (Observation.stop_completed_at)


class SignalSource(Protocol):
    def snapshot(self) -> FleetSignals:
        """The latest fleet-wide signals (an in-memory read; called once per pass)."""
        ...


class NotDelivered(Exception):
    """A command could not be handed to the transport (broker down); nothing was sent."""


class NodeCommander(Protocol):
    """Carries out the training-side actions (checkpoint, drain, stop) for the loop."""

    async def request_checkpoint(self, deadline: float | None, reason: str) -> None: ...

    async def drain(self, instance_id: str, deadline: float | None, reason: str, msg_id: str | None = None) -> None:
        """Send a drain; raises NotDelivered when it could not be sent (the journal retries)."""
        ...

    def node_state(self, instance_id: str) -> str | None:
        """What the node's agent last said it is doing ("training", "draining", ...), if known."""
        ...

    async def stop_job(self, reason: str) -> None: ...

    async def resume_job(self, reason: str) -> None:
        """Undo a stop (a team's pause ends): the job's rendezvous takes nodes again."""
        ...


class SpendSource(Protocol):
    async def spent_usd(self, now: float) -> float:
        """Everything accrued so far (the budget ledger), 60 s minimum charges included."""
        ...


class PassBound(Protocol):
    """Bounds each pass from outside the job: a team member's allotment (fleetd/team/member.py)
    turns into the config and observation the planner sees this pass."""

    async def bound(self, obs: Observation, cfg: FleetdConfig, now: float) -> tuple[Observation, FleetdConfig]: ...


class LedgerSink(Protocol):
    """The budget ledger (fleetd.reconcile.ledger_store.LedgerStore): append-only events, each
    stored once per ``event_id``; also the loop's SpendSource."""

    async def append(self, *events: Any) -> int: ...

    async def spent_usd(self, now: float) -> float: ...


class NoSignals:
    def snapshot(self) -> FleetSignals:
        return FleetSignals()


class NoObserver:
    """No intake wired in: nodes are seen through EC2 only."""

    def track(self, instance_id: str) -> None:
        pass

    def observe(self, node: Node) -> Node:
        return node


class LoggingCommander:
    """Used until the rendezvous/agent command side is wired in: says what it would do."""

    async def request_checkpoint(self, deadline: float | None, reason: str) -> None:
        log.warning("checkpoint_not_delivered", reason=reason, why="no node commander configured")

    async def drain(self, instance_id: str, deadline: float | None, reason: str, msg_id: str | None = None) -> None:
        log.warning("drain_not_delivered", instance_id=instance_id, reason=reason, why="no node commander configured")

    def node_state(self, instance_id: str) -> str | None:
        return None

    async def stop_job(self, reason: str) -> None:
        log.warning("stop_not_delivered", reason=reason, why="no node commander configured")

    async def resume_job(self, reason: str) -> None:
        log.warning("resume_not_delivered", reason=reason, why="no node commander configured")


class NoSpend:
    async def spent_usd(self, now: float) -> float:
        return 0.0
