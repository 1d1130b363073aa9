"""On-demand prices from the AWS Price List API (``pricing:GetProducts``), with the bundled GPU
catalog as the fallback.

One paginated TERM_MATCH request per instance type, refreshed daily; an entry without the expected
shape (``parse_entry``) is rejected and logged, never fatal. A type the API does not price, or an
API that cannot be reached, falls back to the catalog's licensed prices only (catalog.py); which
source priced what is logged once per refresh and kept in ``sources``. (docs/DESIGN.md "Prices")
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetd.adapters.aws_errors import AwsError, aws_call
from fleetd.adapters.catalog import Catalog
from fleetd.adapters.pricing import PoolPrice
from fleetd.policy.model import PoolId
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

SERVICE_CODE = "AmazonEC2"
# The products that are an instance-hour of Linux on shared hardware with nothing pre-installed,
# and that price running capacity ("Used"; "UnusedCapacityReservation" etc. are other SKUs).
FIXED_FILTERS = {
    "operatingSystem": "Linux",
    "tenancy": "Shared",
    "preInstalledSw": "NA",
    "capacitystatus": "Used",
}
PRICE_LIST_SOURCE = "price-list"
DAY_S = 24 * 3600.0
RETRY_AFTER_FAILURE_S = 3600.0


class PriceListEntryError(ValueError):
    """One GetProducts entry is not an on-demand instance-hour price we can use."""


@dataclass(frozen=True, slots=True)
class OnDemandEntry:
    instance_type: str
    region: str
    usd_per_hour: float
    sku: str = ""


def filters_for(instance_type: str, region: str) -> list[dict[str, str]]:
    fields = {"instanceType": instance_type, "regionCode": region, **FIXED_FILTERS}
    return [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in fields.items()]


def parse_entry(item: str | Mapping[str, Any]) -> OnDemandEntry:
    """One PriceList item (a JSON string, as AWS sends it; botocore does not decode them) -> its
    on-demand hourly price. The shape::

        {"product": {"sku": "...", "attributes": {"instanceType": "g5.xlarge", "regionCode": "us-east-1",
                     "operatingSystem": "Linux", "tenancy": "Shared", "preInstalledSw": "NA",
                     "capacitystatus": "Used", ...}},
         "serviceCode": "AmazonEC2",
         "terms": {"OnDemand": {"<sku>.<offerTermCode>": {"priceDimensions": {"<sku>.<offer>.<rate>":
                     {"unit": "Hrs", "pricePerUnit": {"USD": "1.0060000000"}, ...}}, ...}}},
         "publicationDate": "..."}
    """
    try:
        doc = json.loads(item) if isinstance(item, (str, bytes)) else item
    except json.JSONDecodeError as exc:
        raise PriceListEntryError(f"not JSON: {exc}") from None
    if not isinstance(doc, Mapping):
        raise PriceListEntryError("entry is not an object")
    product = doc.get("product")
    attrs = product.get("attributes") if isinstance(product, Mapping) else None
    if not isinstance(attrs, Mapping):
        raise PriceListEntryError("no product.attributes")
    assert isinstance(product, Mapping)  # attrs came from it
    itype, region = attrs.get("instanceType"), attrs.get("regionCode")
    if not isinstance(itype, str) or not itype or not isinstance(region, str) or not region:
        raise PriceListEntryError("no instanceType/regionCode")
    for name, want in FIXED_FILTERS.items():
        if attrs.get(name, want) != want:
            raise PriceListEntryError(f"{itype}: {name}={attrs.get(name)!r}, want {want!r}")
    terms = doc.get("terms")
    on_demand = terms.get("OnDemand") if isinstance(terms, Mapping) else None
    if not isinstance(on_demand, Mapping) or not on_demand:
        raise PriceListEntryError(f"{itype}: no terms.OnDemand")
    prices = _hourly_prices(itype, on_demand)
    if len(prices) != 1:
        raise PriceListEntryError(f"{itype}: {len(prices)} hourly price dimensions, want 1")
    return OnDemandEntry(itype, region, prices[0], str(product.get("sku", "")))


def _hourly_prices(itype: str, on_demand: Mapping[str, Any]) -> list[float]:
    """USD per hour of every hourly price dimension of the OnDemand terms."""
    prices = []
    for term in on_demand.values():
        dims = term.get("priceDimensions") if isinstance(term, Mapping) else None
        if not isinstance(dims, Mapping):
            raise PriceListEntryError(f"{itype}: an OnDemand term without priceDimensions")
        for dim in dims.values():
            if not isinstance(dim, Mapping) or dim.get("unit") not in ("Hrs", "Hours"):
                continue
            per_unit = dim.get("pricePerUnit")
            usd: Any = per_unit.get("USD") if isinstance(per_unit, Mapping) else None
            try:
                value = float(usd)
            except (TypeError, ValueError):
                raise PriceListEntryError(f"{itype}: pricePerUnit.USD={usd!r}") from None
            # A zero price is a placeholder SKU; NaN and infinity are garbage.
            if not (value > 0 and math.isfinite(value)):
                raise PriceListEntryError(f"{itype}: pricePerUnit.USD={usd!r} is not a price")
            prices.append(value)
    return prices


class OnDemandPrices:
    """A PriceSource for on-demand prices only (``spot`` is None): Price List API first, the
    bundled catalog for whatever it could not price."""

    def __init__(
        self,
        region: str,
        catalog: Catalog,
        *,
        client: Any = None,
        refresh_s: float = DAY_S,  # list prices change a few times a year; keeps them off the pass
        page_size: int = 100,
    ):
        self.region = region
        self.catalog = catalog
        self._client = client
        self.refresh_s = refresh_s
        self.page_size = page_size
        self._od: dict[str, float] = {}
        self.sources: dict[str, str] = {}  # instance type -> where its price came from
        self._next_refresh: float | None = None
        self._types: frozenset[str] = frozenset()

    @property
    def quotes(self) -> dict[str, tuple[float, str]]:
        """instance type -> (USD/h, where it came from), as of the last refresh."""
        return {t: (usd, self.sources[t]) for t, usd in self._od.items()}

    async def fetch(self, instance_type: str) -> float | None:
        """The Price List API's price for one type in this region; None if it lists none.
        Malformed entries are logged and skipped. API errors propagate (the caller falls back)."""
        paginator = self._client.get_paginator("get_products")
        found: dict[float, str] = {}
        async with aws_call("GetProducts"):
            pages = [
                page
                async for page in paginator.paginate(
                    ServiceCode=SERVICE_CODE,
                    Filters=filters_for(instance_type, self.region),
                    FormatVersion="aws_v1",
                    PaginationConfig={"PageSize": self.page_size},
                )
            ]
        for page in pages:
            for item in page.get("PriceList", []):
                try:
                    entry = parse_entry(item)
                except PriceListEntryError as exc:
                    log.warning(
                        "price_list_entry_rejected", instance_type=instance_type, region=self.region, error=str(exc)
                    )
                    continue
                if entry.instance_type != instance_type or entry.region != self.region:
                    log.warning(
                        "price_list_entry_rejected",
                        instance_type=instance_type,
                        region=self.region,
                        error=f"answer is for {entry.instance_type} in {entry.region}",
                    )
                    continue
                found[entry.usd_per_hour] = entry.sku
        if len(found) > 1:
            # Two list prices for one type: bid against the lower, and say so (the filters
            # should make this impossible; AWS adding an attribute could break that).
            log.warning("price_list_ambiguous", instance_type=instance_type, region=self.region, prices=sorted(found))
        return min(found) if found else None

    async def refresh(self, types: Sequence[str], now: float) -> None:
        od: dict[str, float] = {}
        sources: dict[str, str] = {}
        error = None
        if self._client is not None:
            for itype in sorted(set(types)):
                try:
                    price = await self.fetch(itype)
                except AwsError as exc:  # unreachable, no permission, throttled: use the catalog
                    error = str(exc)
                    break
                if price is not None:
                    od[itype] = price
                    sources[itype] = PRICE_LIST_SOURCE
        for itype in types:
            if itype not in od:
                fallback = self.catalog.on_demand(itype, self.region)
                if fallback is not None:
                    od[itype] = fallback
                    sources[itype] = self.catalog.label
        self._od, self.sources = od, sources
        self._types = frozenset(types)
        self._next_refresh = now + (RETRY_AFTER_FAILURE_S if error else self.refresh_s)
        unpriced = sorted(set(types) - set(od))
        unverified = [t for t in unpriced if self.catalog.listed_on_demand(t, self.region)[0] is not None]
        api = sorted(t for t, s in sources.items() if s == PRICE_LIST_SOURCE)
        if error is not None:
            log.warning(
                "on_demand_prices_fallback",
                region=self.region,
                source=self.catalog.label,
                error=error,
                retry_in_s=RETRY_AFTER_FAILURE_S,
            )
        log.info(
            "on_demand_prices",
            region=self.region,
            from_price_list=len(api),
            from_catalog=sorted(t for t in sources if t not in api),
            catalog=self.catalog.label,
            unpriced=unpriced,
            # A static price exists but no licensed source backs it: unknown until the API answers.
            unpriced_catalog_unverified=unverified,
        )

    async def prices(self, pools: Sequence[PoolId], now: float) -> dict[PoolId, PoolPrice]:
        types = frozenset(p.instance_type for p in pools)
        if self._next_refresh is None or now >= self._next_refresh or not types <= self._types:
            await self.refresh(sorted(types | self._types), now)
        return {p: PoolPrice(p, None, self._od[p.instance_type]) for p in pools if p.instance_type in self._od}
