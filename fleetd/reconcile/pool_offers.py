"""Every configured pool becomes an offer for the planner or an exclusion with a reason.

A pool is never dropped silently: one without an on-demand price (the Price List API and the
bundled catalog list none for its type in this region) or without hardware facts is excluded, the
reason is logged once (and again only when it changes), and ``fleetd status`` shows it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fleetd.adapters.pricing import Hardware, PoolPrice
from fleetd.policy.model import PoolId, PoolOffer
from fleetd.shared.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class PoolRow:
    """One configured pool as the last pass saw it (for status.json and logs)."""

    pool: PoolId
    offer: PoolOffer | None
    excluded: str | None = None  # the reason, when there is no offer
    spot_price: float | None = None
    on_demand_price: float | None = None


def region_of(zone: str) -> str:
    return zone[:-1] if zone and zone[-1].isalpha() else zone


def pool_rows(
    pools: Sequence[PoolId], prices: Mapping[PoolId, PoolPrice], hardware: Mapping[str, Hardware]
) -> tuple[PoolRow, ...]:
    rows = []
    for pool in pools:
        price = prices.get(pool)
        hw = hardware.get(pool.instance_type)
        spot = price.spot if price else None
        od = price.on_demand if price else None
        reason = None
        if hw is None:
            reason = (
                f"no hardware facts for {pool.instance_type} (neither DescribeInstanceTypes nor the "
                "GPU catalog describe it)"
            )
        elif hw.gpus < 1:
            reason = f"{pool.instance_type} has no whole GPU"
        elif od is None:
            reason = (
                f"no on-demand price for {pool.instance_type} in {region_of(pool.zone)}: the Price List "
                "API has not priced it and the bundled GPU catalog has no licensed price for it there "
                "(an unverified static number is unknown until the API answers): it cannot be "
                "budgeted or bid on"
            )
        if reason is not None:
            rows.append(PoolRow(pool, None, reason, spot, od))
            continue
        assert hw is not None and od is not None  # no reason: both are known
        offer = PoolOffer(
            pool=pool,
            gpus=hw.gpus,
            spot_price=spot,
            on_demand_price=od,
            gpu_model=hw.gpu_model,
            gpu_memory_gib=hw.gpu_memory_gib,
            relative_throughput=hw.relative_throughput,
            spot_price_trend=price.trend if price else 0.0,
        )
        rows.append(PoolRow(pool, offer, None, spot, od))
    return tuple(rows)


class ExclusionLog:
    """Logs each pool's exclusion once, and its return once; not every pass."""

    def __init__(self) -> None:
        self._said: dict[PoolId, str] = {}

    def update(self, rows: Sequence[PoolRow]) -> None:
        for row in rows:
            before = self._said.get(row.pool)
            if row.excluded is not None and row.excluded != before:
                log.warning("pool_excluded", pool=str(row.pool), reason=row.excluded)
                self._said[row.pool] = row.excluded
            elif row.excluded is None and before is not None:
                log.info("pool_included", pool=str(row.pool), was=before)
                del self._said[row.pool]
