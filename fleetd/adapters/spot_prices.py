"""The reconcile loop's spot prices: the price in force now per pool, refreshed on their own
interval and reused by every pass while fresh.

A pass used to ask DescribeSpotPriceHistory for six hours of history per pool (and again after
each launch) to compute a trend no policy reads. Spot prices move a few times a day, so, as
Karpenter's pricing provider does, they are fetched with ``StartTime = now`` (EC2 then answers with
the price in effect at that time: one point per pool, not a window) at most every ``refresh_s``
(``capacity.spot_price_refresh_s``), and served from memory in between. On-demand prices come from
``on_demand`` (fleetd/adapters/price_list.py), which keeps its own daily refresh.

The clock is the caller's ``now`` (the reconciler's clock), so tests and the simulator move it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from fleetd.adapters.pricing import PoolPrice, PriceSource, spot_price_points
from fleetd.policy.model import PoolId
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

DEFAULT_REFRESH_S = 300.0


class LatestSpotPrices:
    """A PriceSource: the current spot price per pool (cached for ``refresh_s``) plus the
    on-demand price from ``on_demand``. A fetch that fails raises, as a per-pass fetch did, and
    the next call tries again (no stale price is served past its TTL)."""

    def __init__(
        self,
        client: Any,
        *,
        on_demand: PriceSource | None = None,
        refresh_s: float = DEFAULT_REFRESH_S,
        product_description: str = "Linux/UNIX",
        page_size: int = 1000,
    ):
        self._client = client
        self._on_demand = on_demand
        self.refresh_s = refresh_s
        self.product_description = product_description
        self.page_size = page_size
        self._spot: dict[PoolId, float] = {}
        self._pools: frozenset[PoolId] = frozenset()  # what the cached fetch asked for
        self._fetched_at: float | None = None
        # The pass and the cloud-call task (after a launch) both read prices: one fetch, not two.
        self._lock = asyncio.Lock()

    def request_params(self, pools: Sequence[PoolId], now: float) -> dict[str, Any]:
        return {
            "InstanceTypes": sorted({p.instance_type for p in pools}),
            "ProductDescriptions": [self.product_description],
            # No EndTime: with StartTime alone EC2 returns the price in effect at StartTime (and
            # any change since), the newest price per pool and nothing older.
            "StartTime": datetime.fromtimestamp(now, UTC),
            "Filters": [{"Name": "availability-zone", "Values": sorted({p.zone for p in pools})}],
            "PaginationConfig": {"PageSize": self.page_size},
        }

    def fresh(self, pools: frozenset[PoolId], now: float) -> bool:
        """The cached prices cover ``pools`` and are younger than ``refresh_s`` (a clock that
        stepped back counts as stale)."""
        at = self._fetched_at
        return at is not None and at <= now < at + self.refresh_s and pools <= self._pools

    async def refresh(self, pools: frozenset[PoolId], now: float) -> None:
        points = await spot_price_points(self._client, self.request_params(sorted(pools), now), sorted(pools))
        self._spot = {pool: series[-1][1] for pool, series in points.items() if series}
        self._pools, self._fetched_at = pools, now
        log.debug("spot_prices_refreshed", pools=len(pools), priced=len(self._spot), next_in_s=self.refresh_s)

    async def prices(self, pools: Sequence[PoolId], now: float) -> dict[PoolId, PoolPrice]:
        wanted = frozenset(pools)
        async with self._lock:
            if not self.fresh(wanted, now):
                # Keep asking for pools seen before (an instance's pool outside the config): the
                # set only changes when the fleet lands somewhere new.
                await self.refresh(wanted | self._pools, now)
        on_demand = await self._on_demand.prices(pools, now) if self._on_demand else {}
        out: dict[PoolId, PoolPrice] = {}
        for pool in pools:
            spot = self._spot.get(pool)
            od = on_demand.get(pool)
            if spot is None and od is None:
                continue
            out[pool] = PoolPrice(pool, spot, od.on_demand if od else None)
        return out
