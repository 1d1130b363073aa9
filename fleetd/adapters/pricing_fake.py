"""The test cloud's prices: what the fault proxy (fleetd/adapters/faults.py) answers for the two
price APIs, in AWS's own payload shapes, built from the bundled GPU catalog.

- ``pricing:GetProducts`` (moto has no Pricing API): the JSON protocol's answer, ``PriceList`` as a
  list of JSON strings with product.attributes and terms.OnDemand...pricePerUnit.USD, filtered by
  the request's TERM_MATCH filters and paginated with ``NextToken``;
- ``ec2:DescribeSpotPriceHistory`` (moto answers "0.00001" dated 2006 for everything): EC2's XML
  with spot prices per pool at a fixed share of the on-demand price, varied per zone, dated inside
  the requested window. These are SYNTHETIC test prices, not market data.

Tests add malformed entries (``PriceListFake.extra``) and change spot prices (``SpotPriceFake.set``).
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any
from xml.sax.saxutils import escape

from fleetd.adapters.catalog import Catalog
from fleetd.policy.model import PoolId

EC2_NS = "http://ec2.amazonaws.com/doc/2016-11-15/"
PUBLICATION_DATE = "2026-08-26T00:00:00Z"
SERVICE_CODE = "AmazonEC2"


def product_entry(instance_type: str, region: str, usd: float, *, vcpu: int = 0, memory_gib: float = 0.0,
                  gpus: float = 0, gpu_memory_gib: float = 0.0, **overrides: str) -> dict[str, Any]:
    """One AmazonEC2 product as GetProducts returns it (before JSON-encoding)."""
    sku = hashlib.sha1(f"{instance_type}/{region}".encode()).hexdigest()[:16].upper()
    offer = "JRTCKXETXF"  # AWS's on-demand offer term code
    rate = "6YS6EN2CT7"
    attrs = {
        "servicecode": SERVICE_CODE,
        "instanceType": instance_type,
        "instanceFamily": "GPU instance",
        "regionCode": region,
        "location": region,
        "locationType": "AWS Region",
        "operatingSystem": "Linux",
        "tenancy": "Shared",
        "preInstalledSw": "NA",
        "capacitystatus": "Used",
        "licenseModel": "No License required",
        "marketoption": "OnDemand",
        "operation": "RunInstances",
        "usagetype": f"BoxUsage:{instance_type}",
        "vcpu": str(vcpu),
        "memory": f"{memory_gib:g} GiB",
        "gpu": f"{gpus:g}",
        "gpuMemory": f"{gpu_memory_gib:g} GiB" if gpu_memory_gib else "NA",
        **overrides,
    }
    return {
        "product": {"productFamily": "Compute Instance", "attributes": attrs, "sku": sku},
        "serviceCode": SERVICE_CODE,
        "terms": {
            "OnDemand": {
                f"{sku}.{offer}": {
                    "priceDimensions": {
                        f"{sku}.{offer}.{rate}": {
                            "unit": "Hrs",
                            "endRange": "Inf",
                            "description": f"${usd:.4f} per On Demand Linux {instance_type} Instance Hour",
                            "appliesTo": [],
                            "rateCode": f"{sku}.{offer}.{rate}",
                            "beginRange": "0",
                            "pricePerUnit": {"USD": f"{usd:.10f}"},
                        }
                    },
                    "sku": sku,
                    "effectiveDate": PUBLICATION_DATE,
                    "offerTermCode": offer,
                    "termAttributes": {},
                }
            }
        },
        "version": "20260826000000",
        "publicationDate": PUBLICATION_DATE,
    }



@dataclass
class PriceListFake:
    """GetProducts over the catalog's prices. ``extra``: more raw PriceList items (strings, as
    AWS sends them) returned to every request, e.g. malformed ones. ``calls``: requests seen."""

    catalog: Catalog
    extra: list[str] = field(default_factory=list)
    page_size: int = 100  # AWS's maximum MaxResults for GetProducts
    calls: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def entries(self) -> list[dict[str, Any]]:
        out = []
        for itype, spec in self.catalog.types.items():
            for region, usd in spec.on_demand.items():
                out.append(product_entry(itype, region, usd, vcpu=spec.vcpu, memory_gib=spec.memory_gib,
                                         gpus=spec.gpus, gpu_memory_gib=spec.gpu_memory_gib))
        return out

    def get_products(self, request: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON body) for one GetProducts request."""
        with self._lock:
            self.calls.append(dict(request))
        if request.get("ServiceCode") != SERVICE_CODE:
            return 400, {"__type": "InvalidParameterException", "Message": "Unknown ServiceCode"}
        wanted: dict[str, str] = {}
        for f in request.get("Filters") or []:
            if f.get("Type") != "TERM_MATCH":
                return 400, {"__type": "InvalidParameterException", "Message": f"unsupported filter {f}"}
            wanted[f["Field"]] = f["Value"]
        items = [json.dumps(e) for e in self.entries()
                 if all(e["product"]["attributes"].get(k) == v for k, v in wanted.items())]
        items += list(self.extra)
        size = min(int(request.get("MaxResults") or self.page_size), self.page_size)
        start = int(request["NextToken"]) if request.get("NextToken") else 0
        body: dict[str, Any] = {"FormatVersion": "aws_v1", "PriceList": items[start:start + size]}
        if start + size < len(items):
            body["NextToken"] = str(start + size)
        return 200, body


@dataclass
class SpotPriceFake:
    """DescribeSpotPriceHistory answers: per pool, ``share`` x the catalog's on-demand price of the
    zone's region, times a per-zone factor in [0.9, 1.1]; ``set`` overrides a pool (None: no
    price, as for a pool AWS does not offer on spot)."""

    catalog: Catalog
    share: float = 0.4
    overrides: dict[PoolId, float | None] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, pool: PoolId, price: float | None) -> None:
        with self._lock:
            self.overrides[pool] = price

    def price(self, pool: PoolId) -> float | None:
        with self._lock:
            if pool in self.overrides:
                return self.overrides[pool]
        region = pool.zone[:-1]
        od, _ = self.catalog.listed_on_demand(pool.instance_type, region)  # the fake stands in for AWS
        if od is None:
            return None
        wobble = 0.9 + 0.2 * (int(hashlib.sha1(str(pool).encode()).hexdigest()[:4], 16) / 0xFFFF)
        return round(od * self.share * wobble, 4)

    def describe(self, params: Mapping[str, str]) -> str:
        """EC2's XML answer for a query-protocol DescribeSpotPriceHistory request."""
        types = [v for k, v in params.items() if k.startswith("InstanceType.")]
        zones = _filter_values(params, "availability-zone")
        if "AvailabilityZone" in params:
            zones.append(params["AvailabilityZone"])
        end = _parse_time(params.get("EndTime")) or datetime.now(timezone.utc)
        start = _parse_time(params.get("StartTime")) or end - timedelta(hours=1)
        items = []
        for itype in sorted(set(types)):
            for zone in sorted(set(zones)):
                price = self.price(PoolId(itype, zone))
                if price is None:
                    continue
                # Two points in the window: a flat series, so the trend is 0 and the price current.
                for t in (start + (end - start) / 3, end - (end - start) / 10):
                    items.append(
                        f"<item><instanceType>{escape(itype)}</instanceType>"
                        f"<productDescription>Linux/UNIX</productDescription>"
                        f"<spotPrice>{price:.6f}</spotPrice>"
                        f"<timestamp>{t.strftime('%Y-%m-%dT%H:%M:%S.000Z')}</timestamp>"
                        f"<availabilityZone>{escape(zone)}</availabilityZone></item>"
                    )
        # Paginated like EC2: MaxResults items per page, an opaque NextToken for the rest.
        size = max(1, int(params.get("MaxResults") or 1000))
        start = int(params["NextToken"]) if params.get("NextToken", "").isdigit() else 0
        page = items[start:start + size]
        token = str(start + size) if start + size < len(items) else ""
        return (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<DescribeSpotPriceHistoryResponse xmlns="{EC2_NS}">'
            f"<requestId>{uuid.uuid4()}</requestId><spotPriceHistorySet>{''.join(page)}</spotPriceHistorySet>"
            f"<nextToken>{token}</nextToken></DescribeSpotPriceHistoryResponse>"
        )


def _filter_values(params: Mapping[str, str], name: str) -> list[str]:
    out = []
    for key, value in params.items():
        if key.startswith("Filter.") and key.endswith(".Name") and value == name:
            prefix = key[: -len("Name")] + "Value."
            out += [v for k, v in params.items() if k.startswith(prefix)]
    return out


def _parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)
