"""The HA state backend in tests: a DynamoDB table on moto server and a fence pinned to one lease.

``state_backend`` is a parametrized fixture: each state unit test runs against SQLite and against
DynamoDB (moto server), through the same fleetd.reconcile.state_port.StateBackend calls.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from fleetd.ha.errors import LeaseLost
from fleetd.ha.table import DynamoTable
from fleetd.policy.lease import LeaseRecord
from fleetd.reconcile.state import StateStore
from fleetd.reconcile.state_dynamo import DynamoStateStore


class PinnedFence:
    """A leader that holds generation ``gen`` for as long as the test says."""

    def __init__(self, holder: str = "host-a", gen: int = 1):
        self.holder, self.gen, self.leading = holder, gen, True

    def generation(self) -> int:
        if not self.leading:
            raise LeaseLost("not leading")
        return self.gen

    def refused(self, what: str) -> None:
        self.leading = False
        raise LeaseLost(what)


async def dynamo_table(client: Any, fleet: str | None = None, holder: str = "host-a") -> DynamoTable:
    """A table with a lease item naming ``holder`` at generation 1."""
    table = DynamoTable(client, "fleetd-state", fleet or "f" + uuid.uuid4().hex[:8])
    await table.ensure()
    assert await table.put_lease(LeaseRecord(holder, 1, "v1"), None)
    return table


Opener = Callable[[], Awaitable[Any]]


@pytest.fixture(params=["sqlite", "dynamodb"])
async def open_state(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Opener]:
    """``await open_state()`` opens the backend (again: a reopen sees what was written)."""
    if request.param == "sqlite":
        yield lambda: StateStore.open(tmp_path)
        return
    session = request.getfixturevalue("aio_session")
    kwargs = request.getfixturevalue("aws_client_kwargs")
    async with session.create_client("dynamodb", **kwargs) as client:
        table = await dynamo_table(client)
        fence = PinnedFence()

        async def opener() -> DynamoStateStore:
            return DynamoStateStore(table, fence)

        yield opener
