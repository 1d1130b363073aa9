"""The hourly price an instance pays now, from its pool's prices and its market."""

from __future__ import annotations

from fleetd.adapters.pricing import PoolPrice
from fleetd.policy.model import Market


def price_of(market: Market, price: PoolPrice | None) -> float:
    if price is None:
        return 0.0
    value = price.spot if market is Market.SPOT else price.on_demand
    return value or 0.0
