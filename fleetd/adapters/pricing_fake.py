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
from datetime import UTC, datetime, timedelta
from typing import Any
from xml.sax.saxutils import escape

from fleetd.adapters.catalog import Catalog
from fleetd.policy.model import PoolId

EC2_NS = "http://ec2.amazonaws.com/doc/2016-11-15/"
PUBLICATION_DATE = "2026-08-26T00:00:00Z"
SERVICE_CODE = "AmazonEC2"


# The Price List's "location" is a display name beside "regionCode" (a few; others fall back to the code).
LOCATIONS = {
    "us-east-1": "US East (N. Virginia)",
    "us-east-2": "US East (Ohio)",
    "us-west-1": "US West (N. California)",
    "us-west-2": "US West (Oregon)",
    "eu-west-1": "EU (Ireland)",
    "eu-west-2": "EU (London)",
    "eu-central-1": "EU (Frankfurt)",
    "ap-northeast-1": "Asia Pacific (Tokyo)",
}
ON_DEMAND_OFFER = "JRTCKXETXF"  # AWS's on-demand offer term code
HOURLY_RATE = "6YS6EN2CT7"  # the rate code of an hourly price dimension
UPFRONT_RATE = "2TG2D8R56U"  # the rate code of a reserved term's upfront fee
# Reserved terms as GetProducts returns them beside OnDemand (it does not filter terms): offer
# code, lease, class, purchase option, hourly share of the on-demand price (None: no hourly
# dimension), upfront fee in hours of on-demand (None: none). "All Upfront" carries an hourly
# dimension priced 0.0000000000: a parser must read OnDemand only.
RESERVED_TERMS = (
    ("HU7G6KETJZ", "1yr", "standard", "Partial Upfront", 0.30, 2640.0),
    ("6QCMYABX3D", "1yr", "standard", "All Upfront", 0.0, 5170.0),
    ("4NA7Y494T4", "1yr", "standard", "No Upfront", 0.63, None),
)


def product_entry(
    instance_type: str,
    region: str,
    usd: float,
    *,
    vcpu: int = 0,
    memory_gib: float = 0.0,
    gpus: float = 0,
    gpu_memory_gib: float = 0.0,
    **overrides: str,
) -> dict[str, Any]:
    """One AmazonEC2 product as GetProducts returns it (before JSON-encoding): the structure of
    recorded real answers (tests/data/price_list_recorded_shape.json; tests/test_price_list.py
    compares the two key by key)."""
    sku = hashlib.sha1(f"{instance_type}/{region}".encode()).hexdigest()[:16].upper()
    attrs = {
        **_attributes(
            instance_type, region, vcpu=vcpu, memory_gib=memory_gib, gpus=gpus, gpu_memory_gib=gpu_memory_gib
        ),
        **overrides,
    }
    on_demand_dim = _dimension(
        sku, ON_DEMAND_OFFER, HOURLY_RATE, "Hrs", usd, f"${usd:.4f} per On Demand Linux {instance_type} Instance Hour"
    )
    return {
        "product": {"productFamily": "Compute Instance", "attributes": attrs, "sku": sku},
        "serviceCode": SERVICE_CODE,
        "terms": {
            "OnDemand": {
                f"{sku}.{ON_DEMAND_OFFER}": _term(
                    sku, ON_DEMAND_OFFER, {f"{sku}.{ON_DEMAND_OFFER}.{HOURLY_RATE}": on_demand_dim}, {}
                )
            },
            "Reserved": _reserved_terms(sku, instance_type, usd),
        },
        "version": "20260826000000",
        "publicationDate": PUBLICATION_DATE,
    }


def _attributes(
    instance_type: str, region: str, *, vcpu: int, memory_gib: float, gpus: float, gpu_memory_gib: float
) -> dict[str, str]:
    return {
        "enhancedNetworkingSupported": "Yes",
        "intelTurboAvailable": "No",
        "memory": f"{memory_gib:g} GiB",
        "dedicatedEbsThroughput": "Up to 3500 Mbps",
        "vcpu": str(vcpu),
        "classicnetworkingsupport": "false",
        "capacitystatus": "Used",
        "locationType": "AWS Region",
        "storage": "EBS only",
        "instanceFamily": "GPU instance",
        "operatingSystem": "Linux",
        "intelAvx2Available": "No",
        "regionCode": region,
        "gpu": f"{gpus:g}",
        "physicalProcessor": "NA",
        "clockSpeed": "NA",
        "ecu": "NA",
        "networkPerformance": "Up to 10 Gigabit",
        "servicename": "Amazon Elastic Compute Cloud",
        "gpuMemory": f"{gpu_memory_gib:g} GB" if gpu_memory_gib else "NA",
        "vpcnetworkingsupport": "true",
        "instanceType": instance_type,
        "tenancy": "Shared",
        "usagetype": f"BoxUsage:{instance_type}",
        "normalizationSizeFactor": "NA",
        "intelAvxAvailable": "No",
        "processorFeatures": "NA",
        "servicecode": SERVICE_CODE,
        "licenseModel": "No License required",
        "currentGeneration": "Yes",
        "preInstalledSw": "NA",
        "location": LOCATIONS.get(region, region),
        "processorArchitecture": "64-bit",
        "marketoption": "OnDemand",
        "operation": "RunInstances",
        "availabilityzone": "NA",
    }


def _dimension(sku: str, code: str, rate: str, unit: str, value: float, description: str) -> dict[str, Any]:
    ranged = {"endRange": "Inf"} if unit == "Hrs" else {}
    out: dict[str, Any] = {
        "unit": unit,
        **ranged,
        "description": description,
        "appliesTo": [],
        "rateCode": f"{sku}.{code}.{rate}",
    }
    if unit == "Hrs":
        out["beginRange"] = "0"
    out["pricePerUnit"] = {"USD": f"{value:.10f}" if unit == "Hrs" else f"{value:g}"}
    return out


def _term(sku: str, code: str, dims: dict[str, Any], attributes: dict[str, str]) -> dict[str, Any]:
    return {
        "priceDimensions": dims,
        "sku": sku,
        "effectiveDate": PUBLICATION_DATE,
        "offerTermCode": code,
        "termAttributes": attributes,
    }


def _reserved_terms(sku: str, instance_type: str, usd: float) -> dict[str, Any]:
    reserved = {}
    for code, lease, klass, option, hourly, upfront_h in RESERVED_TERMS:
        dims = {}
        what = f"Linux/UNIX (Amazon VPC), {instance_type} reserved instance applied"
        if hourly is not None:
            dims[f"{sku}.{code}.{HOURLY_RATE}"] = _dimension(
                sku, code, HOURLY_RATE, "Hrs", round(usd * hourly, 4), what
            )
        if upfront_h is not None:
            dims[f"{sku}.{code}.{UPFRONT_RATE}"] = _dimension(
                sku, code, UPFRONT_RATE, "Quantity", round(usd * upfront_h), "Upfront Fee"
            )
        reserved[f"{sku}.{code}"] = _term(
            sku, code, dims, {"LeaseContractLength": lease, "OfferingClass": klass, "PurchaseOption": option}
        )
    return reserved


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
                out.append(
                    product_entry(
                        itype,
                        region,
                        usd,
                        vcpu=spec.vcpu,
                        memory_gib=spec.memory_gib,
                        gpus=spec.gpus,
                        gpu_memory_gib=spec.gpu_memory_gib,
                    )
                )
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
        items = [
            json.dumps(e)
            for e in self.entries()
            if all(e["product"]["attributes"].get(k) == v for k, v in wanted.items())
        ]
        items += list(self.extra)
        size = min(int(request.get("MaxResults") or self.page_size), self.page_size)
        start = int(request["NextToken"]) if request.get("NextToken") else 0
        body: dict[str, Any] = {"FormatVersion": "aws_v1", "PriceList": items[start : start + size]}
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
        end = _parse_time(params.get("EndTime")) or datetime.now(UTC)
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
        first = int(params["NextToken"]) if params.get("NextToken", "").isdigit() else 0
        page = items[first : first + size]
        token = str(first + size) if first + size < len(items) else ""
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
    return t if t.tzinfo else t.replace(tzinfo=UTC)
