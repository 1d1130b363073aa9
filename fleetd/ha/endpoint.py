"""The leader says where the rendezvous store is: once per takeover, the endpoint of its own
host's store goes into the shared state (``meta.rendezvous_endpoint``, fenced like every write)
and out as a retained MQTT message on ``fleetd/<fleet>/rendezvous`` (a versioned
fleetd.protocol.messages.RendezvousEndpoint), so an agent (re)connecting reads the newest one.

Agents follow it: a newer generation naming another host:port restarts their torchrun against
that store (agent/supervise/endpoint_follow.py; DESIGN.md, "High availability").
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fleetd.config import FleetdConfig
from fleetd.ha.election import Election
from fleetd.intake.mqtt import BusUnavailable
from fleetd.protocol.messages import RendezvousEndpoint
from fleetd.protocol.topics import rendezvous_topic
from fleetd.reconcile.state_port import StateBackend
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

RETRY_S = 1.0


def endpoint_publisher(
    cfg: FleetdConfig,
    holder: str,
    election: Election,
    state: StateBackend,
    publish: Callable[[str, bytes], Awaitable[None]],
) -> Callable[[Any], Awaitable[None]]:
    async def publish_rendezvous_endpoint(ctx: Any) -> None:
        endpoint = RendezvousEndpoint(
            host=cfg.ha.advertise_host or holder,
            port=cfg.rendezvous.port,
            run_id=cfg.rendezvous.run_id,
            leader=holder,
            generation=election.generation(),
        )
        await state.set_meta("rendezvous_endpoint", endpoint.model_dump(mode="json"))
        topic = rendezvous_topic(cfg.fleet.name)
        while True:
            election.generation()  # a host that lost the lease stops publishing (raises LeaseLost)
            try:
                await publish(topic, endpoint.to_json())
                break
            except BusUnavailable as exc:
                log.warning("rendezvous_endpoint_not_published", error=str(exc), retry_in_s=RETRY_S)
                await asyncio.sleep(RETRY_S)
        log.info(
            "rendezvous_endpoint_published",
            topic=topic,
            host=endpoint.host,
            port=endpoint.port,
            generation=endpoint.generation,
        )

    return publish_rendezvous_endpoint
