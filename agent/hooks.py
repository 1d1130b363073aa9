"""The interface between the agent and what it drives on the node.

``agent.main`` (the composition at the top) builds an ``AgentContext`` and hands it to a hooks
factory; ``agent.supervise`` implements ``NodeHooks`` for a node that trains. The interface lives
here, below both, so the supervisor never imports the agent that calls it (no import cycle).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from agent.config import AgentConfig
from agent.node.imds import Identity
from agent.node.log_sink import WorkerLogSink
from agent.node.trainer_channel import TrainerProgress
from fleetd.protocol.messages import (
    CheckpointCommand,
    DrainCommand,
    LeaveCommand,
    Message,
    NodeState,
    Notice,
    Rebalance,
    RendezvousEndpoint,
    RestartTrainerCommand,
    ShutdownCommand,
)
from fleetd.protocol.trainer import CheckpointSavedLocally
from fleetd.shared.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class AgentContext:
    """What the hooks may use: identity, config, and the agent's ways to report."""

    config: AgentConfig
    identity: Identity
    publish_event: Callable[[Message], Awaitable[None]]  # QoS 1 via the outbox
    set_state: Callable[[NodeState], Awaitable[None]]  # retained status: ready/training/draining/leaving
    trainer_progress: Callable[[], TrainerProgress]
    request_stop: Callable[[], None]  # begin the agent's clean shutdown
    # Where the workers' output lines go besides torchrun.log: journald, the control host.
    worker_logs: WorkerLogSink | None = None


class NodeHooks(Protocol):
    """The node's emergency path and trainer supervision (``agent.supervise.elastic_hooks`` implements it)."""

    async def run(self) -> None:
        """Long-running work (supervise torchrun). Returning early is fine."""

    async def on_notice(self, notice: Notice) -> None:
        """A spot interruption notice: start checkpoint → upload → leave now, locally."""

    async def on_rebalance(self, rebalance: Rebalance) -> None:
        """A rebalance recommendation: a risk signal only; the controller decides."""

    async def on_checkpoint_saved(self, report: CheckpointSavedLocally) -> None:
        """The trainer saved a checkpoint locally (upload it)."""

    async def on_checkpoint(self, command: CheckpointCommand) -> None: ...

    async def on_drain(self, command: DrainCommand) -> None: ...

    async def on_leave(self, command: LeaveCommand) -> None: ...

    async def on_shutdown(self, command: ShutdownCommand) -> None:
        """Stop training cleanly; the agent stops itself after this returns."""

    async def on_restart_trainer(self, command: RestartTrainerCommand) -> None:
        """fleetd saw the job stalled: start the trainer again."""

    async def on_endpoint(self, endpoint: RendezvousEndpoint) -> None:
        """The leading controller advertised its rendezvous store (after a failover, a new one):
        move torchrun to it (agent.supervise.endpoint_follow decides whether it is new)."""

    async def on_controller_lost(self, reason: str) -> int | None:
        """The control host is gone (dead man's switch): stop training for good and make the
        newest checkpoint durable; return its step. The agent powers the node off afterwards."""

    async def stop(self) -> None:
        """Agent shutdown (SIGTERM): stop what ``run`` started. Bounded by the caller."""


class LoggingHooks:
    """Hooks for a node that does not train (``node.supervise_training = false``): log what would be done."""

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx

    async def run(self) -> None:
        return None

    async def on_notice(self, notice: Notice) -> None:
        log.warning("hook_notice", action=notice.action, action_time=notice.action_time.isoformat())
        await self.ctx.set_state("draining")  # what a training node would be doing now

    async def on_rebalance(self, rebalance: Rebalance) -> None:
        log.info("hook_rebalance", notice_time=rebalance.notice_time.isoformat())

    async def on_checkpoint_saved(self, report: CheckpointSavedLocally) -> None:
        log.info("hook_checkpoint_saved", step=report.step)

    async def on_checkpoint(self, command: CheckpointCommand) -> None:
        log.info("hook_checkpoint", reason=command.reason)

    async def on_drain(self, command: DrainCommand) -> None:
        log.info("hook_drain", reason=command.reason, msg_id=command.msg_id)
        await self.ctx.set_state("draining")

    async def on_leave(self, command: LeaveCommand) -> None:
        log.info("hook_leave", reason=command.reason)

    async def on_shutdown(self, command: ShutdownCommand) -> None:
        log.info("hook_shutdown", reason=command.reason)

    async def on_restart_trainer(self, command: RestartTrainerCommand) -> None:
        log.info("hook_restart_trainer", reason=command.reason)

    async def on_endpoint(self, endpoint: RendezvousEndpoint) -> None:
        log.info("hook_endpoint", host=endpoint.host, port=endpoint.port, generation=endpoint.generation)

    async def on_controller_lost(self, reason: str) -> int | None:
        log.info("hook_controller_lost", reason=reason)
        return None

    async def stop(self) -> None:
        return None


HooksFactory = Callable[[AgentContext], NodeHooks]
