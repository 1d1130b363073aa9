"""The HA parts of `fleetd run` (``[ha] backend = "dynamodb"``): the DynamoDB client and table,
the lease (Election), and the state and ledger that write through it."""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass, field

from botocore.config import Config

from fleetd.config import FleetdConfig
from fleetd.ha.election import Election
from fleetd.ha.table import DynamoTable
from fleetd.policy.lease import LeaseTiming
from fleetd.reconcile.state_dynamo import DynamoLedger, DynamoStateStore


def host_id(cfg: FleetdConfig) -> str:
    return cfg.ha.host_id or socket.gethostname()


def dynamodb_client_config(lease_s: float) -> Config:
    # A lease step must end well inside the lease: few retries, short timeouts.
    return Config(
        retries={"mode": "standard", "total_max_attempts": 3}, connect_timeout=2, read_timeout=max(2.0, lease_s / 3.0)
    )


@dataclass
class HaParts:
    election: Election
    state: DynamoStateStore
    ledger: DynamoLedger
    _stack: contextlib.AsyncExitStack = field(repr=False)

    async def refresh(self) -> None:
        """Read the shared state again (a standby's step; a new leader's first act)."""
        await self.state.refresh()
        await self.ledger.refresh()

    async def close(self) -> None:
        await self._stack.aclose()


async def open_ha(cfg: FleetdConfig) -> HaParts:
    from aiobotocore.session import get_session

    session = get_session()
    if cfg.aws.profile:
        session.set_config_variable("profile", cfg.aws.profile)
    stack = contextlib.AsyncExitStack()
    try:
        client = await stack.enter_async_context(
            # aiobotocore takes botocore's Config at runtime; its stubs ask for AioConfig.
            session.create_client(  # type: ignore[call-overload]
                "dynamodb",
                region_name=cfg.aws.region,
                endpoint_url=cfg.ha.endpoint_url or cfg.aws.endpoint_url,
                config=dynamodb_client_config(cfg.ha.lease_s),
            )
        )
        table = DynamoTable(client, cfg.ha.table, cfg.fleet.name)
        if cfg.ha.create_table:
            await table.ensure()
    except BaseException:
        await stack.aclose()
        raise
    election = Election(table, host_id(cfg), LeaseTiming.for_lease(cfg.ha.lease_s))
    return HaParts(election, DynamoStateStore(table, election), DynamoLedger(table, election), stack)
