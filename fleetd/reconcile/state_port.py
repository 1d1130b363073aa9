"""What the reconcile loop needs from its state, as one interface with two backends:

- fleetd.reconcile.state.StateStore: SQLite in ``<state_dir>/fleetd.db`` (the embedded default);
- fleetd.reconcile.state_dynamo.DynamoStateStore: a DynamoDB table shared by several control
  hosts, every write fenced by the writer's lease generation (DESIGN.md, "High availability").

Both keep the same rows (fleetd.reconcile.state_rows) with the same meaning; the tests run the
state unit tests against both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from fleetd.policy.model import Market, PoolId
from fleetd.reconcile.state_rows import DrainRecord, InstanceRow, LaunchRow, PoolStatsRow, SeenInstance, SyncReport


class StateBackend(Protocol):
    # -- launches (intents written before CreateFleet, keyed by their client token) -------------
    async def settled_launch_count(self) -> int: ...

    async def record_intent(
        self,
        *,
        token: str,
        seq: int,
        now: float,
        count: int,
        market: Market,
        pools: Sequence[PoolId],
        purpose: str,
        max_price_per_hour: float | None,
        reason: str,
    ) -> None: ...

    async def settle_launch(
        self, token: str, status: str, instance_ids: Iterable[str], now: float, detail: str = ""
    ) -> None: ...

    async def launches(self, status: str | None = None) -> list[LaunchRow]: ...

    async def unresolved_launches(self, since: float) -> list[LaunchRow]: ...

    async def launches_since(self, purpose: str, since: float) -> int: ...

    # -- instances ------------------------------------------------------------------------------
    async def record_launched(
        self, seen: Sequence[SeenInstance], max_price_per_hour: float | None, now: float
    ) -> None: ...

    async def sync_instances(self, seen: Sequence[SeenInstance], now: float) -> SyncReport: ...

    async def instances(self, open_only: bool = True) -> list[InstanceRow]: ...

    async def instances_by_id(self, instance_ids: Sequence[str]) -> list[InstanceRow]: ...

    async def mark_terminate_requested(self, instance_ids: Sequence[str], now: float) -> None: ...

    async def record_notice(self, instance_id: str, at: float) -> bool: ...

    # -- the drain/termination journal (fleetd.reconcile.journal) ------------------------------
    async def record_drain(self, instance_id: str, now: float, deadline: float | None, reason: str) -> DrainRecord: ...

    async def mark_drain_sent(self, instance_id: str, now: float) -> None: ...

    async def unsent_drains(self) -> list[DrainRecord]: ...

    async def unfinished_terminations(self, before: float) -> list[str]: ...

    # -- pools, meta ----------------------------------------------------------------------------
    async def mark_pool_unavailable(
        self, pool: PoolId, until: float, code: str, market: Market = Market.SPOT
    ) -> None: ...

    async def pool_stats(self) -> list[PoolStatsRow]: ...

    async def get_meta(self, key: str, default: Any = None) -> Any: ...

    async def set_meta(self, key: str, value: Any) -> None: ...

    async def close(self) -> None: ...
