"""Live prices of the pools a config would bid on in one region: what ``fleetd pools --live`` lists
and what the team's loop prices another region with (fleetd/team/region_prices.py)."""

from __future__ import annotations

from typing import Any

from fleetd.policy.model import PoolId


async def live_prices(
    cfg: Any, catalog: Any, region: str, types: list[str], zones: list[str]
) -> tuple[dict[str, tuple[float, str]], dict[PoolId, float], list[str]]:
    """On-demand quotes (Price List API, the catalog for what it does not price), current spot
    prices and the zones, for ``types`` in ``region`` (``zones``: all of the region's when empty)."""
    import time

    from aiobotocore.session import get_session

    from fleetd.adapters.aws_clients import client_kwargs, pricing_client_kwargs
    from fleetd.adapters.ec2_pools import default_zones
    from fleetd.adapters.price_list import OnDemandPrices
    from fleetd.adapters.pricing import Ec2SpotPriceSource

    session = get_session()
    if cfg.aws.profile:
        session.set_config_variable("profile", cfg.aws.profile)
    ec2_kwargs = client_kwargs(cfg, region)
    now = time.time()
    async with (
        session.create_client("pricing", **pricing_client_kwargs(cfg)) as pricing,
        session.create_client("ec2", **ec2_kwargs) as ec2,
    ):
        zones = zones or list(await default_zones(ec2, ()))
        od = OnDemandPrices(region, catalog, client=pricing)
        await od.refresh(types, now)
        history = await Ec2SpotPriceSource(ec2).history([PoolId(t, z) for t in types for z in zones], now)
    spot = {pool: points[-1][1] for pool, points in history.items() if points}
    return od.quotes, spot, zones
