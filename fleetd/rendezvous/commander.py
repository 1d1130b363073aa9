"""The daemon's side of the rendezvous: the steering component and a NodeCommander
(fleetd.reconcile.ports) that carries the planner's checkpoint/drain/stop actions out through the
rendezvous store (and, when given one, MQTT commands to the agents).

    client = RendezvousClient(cfg.rendezvous.host, cfg.rendezvous.port, cfg.rendezvous.run_id)
    steerer = Steerer(client, SteerSettings(min_nodes=..., max_nodes=...), on_leave=...)
    plugins = Plugins(components=[steering_component(steerer)], commander=RendezvousCommander(...))
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from fleetd.protocol.logs import get_logger
from fleetd.protocol.messages import Command, DrainCommand, ShutdownCommand
from fleetd.rendezvous.client import RendezvousClient
from fleetd.rendezvous.errors import RendezvousError, RendezvousUnavailable
from fleetd.rendezvous.steering import Steerer

log = get_logger(__name__)

SendCommand = Callable[[str, Command], Awaitable[None]]  # (instance_id, command) -> published


def steering_component(steerer: Steerer):  # -> fleetd.daemon.Component
    async def run(ctx) -> None:  # noqa: ANN001 - fleetd.daemon.DaemonContext
        while not ctx.stopping.is_set():
            try:
                await steerer.client.connect()
                break
            except RendezvousUnavailable as exc:
                log.warning("rendezvous_unreachable", error=str(exc))
                try:
                    await asyncio.wait_for(ctx.stopping.wait(), 2.0)
                except TimeoutError:
                    pass
        await steerer.run(ctx.stopping)

    return run


class RendezvousCommander:
    """fleetd.reconcile.ports.NodeCommander over the rendezvous store (+ MQTT when wired)."""

    def __init__(
        self,
        client: RendezvousClient,
        addr_of: Callable[[str], str | None],
        send_command: SendCommand | None = None,
        steerer: Steerer | None = None,
    ) -> None:
        self.client = client
        self.addr_of = addr_of  # instance id -> node address (the agent's status carries it)
        self.send_command = send_command
        self.steerer = steerer

    async def request_checkpoint(self, deadline: float | None, reason: str) -> None:
        try:
            await self.client.request_checkpoint(reason)
        except RendezvousError as exc:
            log.error("checkpoint_request_failed", reason=reason, error=str(exc))

    async def drain(self, instance_id: str, deadline: float | None, reason: str) -> None:
        """The agent runs the emergency path on its own notice; this covers planned drains and
        a second, independent signal (EventBridge) for the same node."""
        addr = self.addr_of(instance_id)
        when = datetime.fromtimestamp(deadline, UTC) if deadline is not None else None
        if self.send_command is not None:
            await self.send_command(instance_id, DrainCommand(instance_id=instance_id, reason=reason, deadline=when))
        if addr is not None:
            try:
                await self.client.request_checkpoint(reason, hold=True, leaving=(addr,), by="fleetd")
            except RendezvousError as exc:
                log.error("drain_checkpoint_failed", instance_id=instance_id, error=str(exc))

    async def stop_job(self, reason: str) -> None:
        """Checkpoint, then close the rendezvous so no node re-joins, then tell agents to stop."""
        try:
            seq = await self.client.request_checkpoint(reason, hold=True)
            for _ in range(600):
                acks = await self.client.acks(seq)
                if acks and len(acks) >= acks[0].world_size:
                    break
                await asyncio.sleep(0.1)
            if self.steerer is not None:
                await self.steerer.close_rendezvous()
        except RendezvousError as exc:
            log.error("stop_job_checkpoint_failed", reason=reason, error=str(exc))
        log.info("job_stopped", reason=reason)

    async def shutdown_nodes(self, instance_ids: list[str], reason: str) -> None:
        if self.send_command is None:
            return
        for iid in instance_ids:
            await self.send_command(iid, ShutdownCommand(instance_id=iid, reason=reason))
