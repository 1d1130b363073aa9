"""What a job's other allowed regions offer ([[team.regions]] in its config), for the team's
placement (fleetd/policy/team_region.py): the pools the job's config would bid on there, priced
live (current spot prices, on-demand from the Price List API or the catalog: fleetd/pool_prices.py,
as ``fleetd pools --live`` lists them), reduced to the region's best price per useful GPU-hour.

Prices are fetched at most every ``team.price_refresh_s`` per region and kept between passes; a
region that cannot be priced (AWS refusing, a region that sells none of the types) offers nothing
this pass and is logged: the job is never moved to a region whose price is unknown.
"""

from __future__ import annotations

from fleetd.config import FleetdConfig
from fleetd.policy.team_model import RegionOffer
from fleetd.shared.logs import get_logger
from fleetd.team.inputs import best_offer
from fleetd.team.region_file import allowed_regions, in_region

log = get_logger(__name__)

_Key = tuple[str, tuple[str, ...], str]  # region, instance types, GPU requirements


class RegionPricer:
    def __init__(self, refresh_s: float) -> None:
        self.refresh_s = refresh_s
        self._kept: dict[_Key, tuple[float, RegionOffer | None]] = {}

    async def elsewhere(self, cfg: FleetdConfig, now: float) -> tuple[RegionOffer, ...]:
        """Offers of every allowed region but the one the job runs in (priced ones only)."""
        out = []
        for region in allowed_regions(cfg):
            if region == cfg.aws.region:
                continue
            offer = await self._offer(in_region(cfg, region), now)
            if offer is not None:
                out.append(offer)
        return tuple(out)

    async def _offer(self, there: FleetdConfig, now: float) -> RegionOffer | None:
        cap = there.capacity
        key = (there.aws.region, tuple(cap.instance_types), repr(cap.gpu))
        kept = self._kept.get(key)
        if kept is not None and now - kept[0] < self.refresh_s:
            return kept[1]
        from fleetd.adapters.catalog import bundled_catalog
        from fleetd.pool_listing import list_pools, types_for
        from fleetd.pool_prices import live_prices

        region = there.aws.region
        catalog = bundled_catalog()
        try:
            types = types_for(catalog, region, cap.instance_types, cap.gpu)
            on_demand, spot, zones = await live_prices(there, catalog, region, types, list(cap.zones))
        except Exception as exc:  # noqa: BLE001 - an unpriced region must not stop the team's loop
            log.warning("team_region_unpriced", region=region, error=repr(exc)[:300], retry_in_s=self.refresh_s)
            self._kept[key] = (now, None)  # offers nothing until priced again, not an old price
            return None
        rows = list_pools(
            catalog,
            region,
            instance_types=cap.instance_types,
            gpu=cap.gpu,
            zones=zones,
            on_demand=on_demand,
            spot=spot,
            configured=True,
        )
        offered = [r for r in rows if r.excluded is None]
        offer = best_offer(region, ((r.spot_usd_per_hour, r.gpus, r.relative_throughput) for r in offered))
        self._kept[key] = (now, offer)
        return offer
