"""On-demand prices from the Price List API (pricing:GetProducts), against the test cloud's fake in
AWS's real payload shape (PriceList = JSON strings, paginated with NextToken), and the fallback
to the bundled GPU catalog."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from fleetd.adapters.catalog import bundled_catalog
from fleetd.adapters.price_list import (
    PRICE_LIST_SOURCE,
    RETRY_AFTER_FAILURE_S,
    OnDemandPrices,
    PriceListEntryError,
    filters_for,
    parse_entry,
)
from fleetd.adapters.pricing_fake import PriceListFake, product_entry
from fleetd.policy.model import PoolId
from tests.reconcile_support import Cloud

G5 = PoolId("g5.xlarge", "us-east-1a")
G4 = PoolId("g4dn.xlarge", "us-east-1b")


def entry(**attrs: str) -> dict:
    return product_entry("g5.xlarge", "us-east-1", 1.006, **attrs)


def test_a_real_shaped_entry_parses_from_its_json_string() -> None:
    e = parse_entry(json.dumps(entry()))  # AWS sends each PriceList item as a JSON string
    assert (e.instance_type, e.region, e.usd_per_hour) == ("g5.xlarge", "us-east-1", 1.006)
    assert e.sku


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: "{not json", "not JSON"),
        (lambda d: json.dumps([d]), "not an object"),
        (lambda d: json.dumps({**d, "product": {"sku": "X"}}), "product.attributes"),
        (lambda d: json.dumps(_set(d, ["product", "attributes", "operatingSystem"], "Windows")), "operatingSystem"),
        (
            lambda d: json.dumps(_set(d, ["product", "attributes", "capacitystatus"], "UnusedCapacityReservation")),
            "capacitystatus",
        ),
        (lambda d: json.dumps({**d, "terms": {"Reserved": {}}}), "terms.OnDemand"),
        (lambda d: json.dumps(_price(d, "0.0000000000")), "not a price"),
        (lambda d: json.dumps(_price(d, "NaN")), "not a price"),
        (lambda d: json.dumps(_price(d, "Infinity")), "not a price"),
        (lambda d: json.dumps(_price(d, "one dollar")), "pricePerUnit"),
        (lambda d: json.dumps(_two_dimensions(d)), "2 hourly price dimensions"),
    ],
)
def test_malformed_entries_are_rejected(mutate, match) -> None:
    with pytest.raises(PriceListEntryError, match=match):
        parse_entry(mutate(entry()))


def _set(d: dict, path: list[str], value: str) -> dict:
    d = json.loads(json.dumps(d))
    node = d
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return d


def _dim(d: dict) -> dict:
    (term,) = d["terms"]["OnDemand"].values()
    (dim,) = term["priceDimensions"].values()
    return dim


def _price(d: dict, usd: str) -> dict:
    d = json.loads(json.dumps(d))
    _dim(d)["pricePerUnit"]["USD"] = usd
    return d


def _two_dimensions(d: dict) -> dict:
    d = json.loads(json.dumps(d))
    (term,) = d["terms"]["OnDemand"].values()
    term["priceDimensions"]["second"] = {**_dim(d), "pricePerUnit": {"USD": "2.0"}}
    return d


def test_request_filters_are_the_price_list_terms() -> None:
    got = {f["Field"]: f["Value"] for f in filters_for("p4d.24xlarge", "eu-west-1")}
    assert got == {
        "instanceType": "p4d.24xlarge",
        "regionCode": "eu-west-1",
        "operatingSystem": "Linux",
        "tenancy": "Shared",
        "preInstalledSw": "NA",
        "capacitystatus": "Used",
    }
    assert all(f["Type"] == "TERM_MATCH" for f in filters_for("g5.xlarge", "us-east-1"))


def test_the_fake_pages_with_next_token_like_aws() -> None:
    fake = PriceListFake(bundled_catalog(), page_size=10)
    seen, token = [], None
    while True:
        req = {
            "ServiceCode": "AmazonEC2",
            "Filters": [{"Type": "TERM_MATCH", "Field": "regionCode", "Value": "us-west-2"}],
            "MaxResults": 10,
        }
        if token:
            req["NextToken"] = token
        status, body = fake.get_products(req)
        assert status == 200 and body["FormatVersion"] == "aws_v1"
        assert all(isinstance(item, str) for item in body["PriceList"])  # JSON strings, as AWS sends
        seen += [json.loads(i)["product"]["attributes"]["instanceType"] for i in body["PriceList"]]
        token = body.get("NextToken")
        if not token:
            break
    assert sorted(seen) == list(bundled_catalog().types_in("us-west-2"))


async def test_prices_come_from_the_api_through_pages_and_bad_entries_are_logged(cloud: Cloud) -> None:
    catalog = bundled_catalog()
    good_but_other = json.dumps(product_entry("g5.xlarge", "us-east-1", 9.99, operatingSystem="Windows"))
    cloud.proxy.price_list.extra = ["{truncated", good_but_other, json.dumps({"product": {}})]
    async with cloud.pricing_client() as client:
        source = OnDemandPrices("us-east-1", catalog, client=client, page_size=2)
        with capture_logs() as logs:
            prices = await source.prices([G5, G4], now=1000.0)
    assert prices[G5].on_demand == 1.006 and prices[G4].on_demand == 0.526
    assert prices[G5].spot is None  # spot comes from DescribeSpotPriceHistory, not from here
    assert source.sources == {"g5.xlarge": PRICE_LIST_SOURCE, "g4dn.xlarge": PRICE_LIST_SOURCE}
    calls = cloud.proxy.calls_of("GetProducts")
    # One real entry + three extra per type, two per page: two pages per type, the second asked
    # for with the first page's NextToken.
    assert len(calls) == 4 and sum(1 for c in calls if c.get("NextToken")) == 2
    assert all(c["ServiceCode"] == "AmazonEC2" and c["MaxResults"] == 2 for c in calls)
    rejected = [e for e in logs if e["event"] == "price_list_entry_rejected"]
    assert len(rejected) == 6  # 3 per type, each logged, none fatal
    assert any("not JSON" in e["error"] for e in rejected) and any("Windows" in e["error"] for e in rejected)
    (summary,) = [e for e in logs if e["event"] == "on_demand_prices"]
    assert summary["from_price_list"] == 2 and summary["from_catalog"] == [] and summary["unpriced"] == []


async def test_prices_are_cached_until_the_refresh(cloud: Cloud) -> None:
    async with cloud.pricing_client() as client:
        source = OnDemandPrices("us-east-1", bundled_catalog(), client=client, refresh_s=3600)
        await source.prices([G5], now=0.0)
        await source.prices([G5], now=1800.0)
        assert len(cloud.proxy.calls_of("GetProducts")) == 1
        await source.prices([G5, G4], now=1900.0)  # a new type: refresh now (both types)
        assert len(cloud.proxy.calls_of("GetProducts")) == 1 + 2
        await source.prices([G5], now=1900.0 + 3599)
        assert len(cloud.proxy.calls_of("GetProducts")) == 3
        await source.prices([G5], now=1900.0 + 3600)  # a day's refresh_s later (an hour here)
        assert len(cloud.proxy.calls_of("GetProducts")) == 3 + 2


async def test_api_down_falls_back_to_the_catalog_and_says_so(cloud: Cloud) -> None:
    catalog = bundled_catalog()
    cloud.proxy.fail("GetProducts", "AccessDeniedException", times=None)
    async with cloud.pricing_client() as client:
        source = OnDemandPrices("us-east-1", catalog, client=client)
        with capture_logs() as logs:
            prices = await source.prices([G5, G4, PoolId("x9.huge", "us-east-1a")], now=0.0)
    assert prices[G5].on_demand == catalog.on_demand("g5.xlarge", "us-east-1") == 1.006
    assert set(prices) == {G5, G4}  # a type nobody prices is left out here; observe excludes it
    assert source.sources["g5.xlarge"] == catalog.label and "2026-08-26" in catalog.label
    (fallback,) = [e for e in logs if e["event"] == "on_demand_prices_fallback"]
    assert "AccessDeniedException" in fallback["error"] and fallback["source"] == catalog.label
    (summary,) = [e for e in logs if e["event"] == "on_demand_prices"]
    assert summary["unpriced"] == ["x9.huge"]
    # Retried an hour later, not every pass.
    assert source._next_refresh == RETRY_AFTER_FAILURE_S


async def test_a_type_the_api_does_not_list_falls_back_per_type(cloud: Cloud) -> None:
    catalog = bundled_catalog()
    cloud.proxy.price_list.catalog = type(catalog)(
        catalog.generated_at,
        catalog.prices_as_of,
        catalog.sources,
        catalog.models,
        {t: s for t, s in catalog.types.items() if t != "g4dn.xlarge"},
    )
    async with cloud.pricing_client() as client:
        source = OnDemandPrices("us-east-1", catalog, client=client)
        prices = await source.prices([G5, G4], now=0.0)
    assert prices[G4].on_demand == 0.526
    assert source.sources == {"g5.xlarge": PRICE_LIST_SOURCE, "g4dn.xlarge": catalog.label}


async def test_without_a_client_only_licensed_catalog_prices_count() -> None:
    # us-east-1: the catalog's prices come from a licensed source (Karpenter's snapshot).
    east = await OnDemandPrices("us-east-1", bundled_catalog()).prices([PoolId("p4d.24xlarge", "us-east-1a")], 0.0)
    assert east[PoolId("p4d.24xlarge", "us-east-1a")].on_demand == pytest.approx(21.957642)
    # eu-west-1: the catalog lists p4d at $23.72/h, but from a table with no license: unknown
    # until the Price List API answers, so the pool goes unpriced (and is excluded with that reason).
    source = OnDemandPrices("eu-west-1", bundled_catalog())
    prices = await source.prices([PoolId("p4d.24xlarge", "eu-west-1a"), PoolId("g6e.xlarge", "eu-west-1a")], 0.0)
    assert bundled_catalog().listed_on_demand("p4d.24xlarge", "eu-west-1") == (pytest.approx(23.71569), False)
    assert prices == {}  # (no g6e in eu-west-1 per the catalog at all)


# --- recorded real payload shapes (tests/data/price_list_recorded_shape.json) -------------------
RECORDED = json.loads((Path(__file__).parent / "data" / "price_list_recorded_shape.json").read_text())


def _shape(obj, sku: str):
    """The structure of a document: keys (with the SKU abstracted) and value types, not values."""
    if isinstance(obj, dict):
        return {k.replace(sku, "SKU"): _shape(v, sku) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_shape(v, sku) for v in obj[:1]]
    return type(obj).__name__


def test_the_fake_speaks_exactly_the_recorded_shape() -> None:
    (raw,) = RECORDED["compute_instance_response"]["PriceList"]
    recorded = json.loads(raw)
    fake = product_entry("g5.xlarge", "us-east-1", 1.006, vcpu=4, memory_gib=16, gpus=1, gpu_memory_gib=24)
    assert _shape(fake, fake["product"]["sku"]) == _shape(recorded, recorded["product"]["sku"])
    # ...and the same answer envelope: FormatVersion, PriceList of JSON strings, NextToken to page on.
    status, body = PriceListFake(bundled_catalog(), page_size=1).get_products(
        {"ServiceCode": "AmazonEC2", "Filters": filters_for("g5.xlarge", "us-east-1")}
    )
    assert status == 200 and set(body) <= set(RECORDED["compute_instance_response"])
    assert all(isinstance(i, str) for i in body["PriceList"])


def test_a_recorded_compute_instance_item_reads_on_demand_only() -> None:
    (raw,) = RECORDED["compute_instance_response"]["PriceList"]
    e = parse_entry(raw)  # its Reserved terms carry Hrs rates too, one of them 0.0 (All Upfront)
    assert (e.instance_type, e.region, e.usd_per_hour) == ("g5.xlarge", "us-east-1", 1.006)


def test_a_recorded_item_of_another_product_family_is_rejected() -> None:
    (raw,) = RECORDED["storage_response"]["PriceList"]
    with pytest.raises(PriceListEntryError, match="instanceType"):
        parse_entry(raw)


class _RecordedPages:
    """A pricing client whose GetProducts answers the recorded pages, as botocore hands them over."""

    def __init__(self, pages: list[dict]):
        self.pages, self.asked = pages, []

    def get_paginator(self, name: str):
        assert name == "get_products"
        outer = self

        class _Paginator:
            def paginate(self, **kwargs):
                outer.asked.append(kwargs)

                async def pages():
                    for page in outer.pages:
                        yield page

                return pages()

        return _Paginator()


async def test_the_live_path_prices_from_recorded_pages() -> None:
    # Two pages as AWS pages them: the compute item (with a NextToken) and a stray storage item.
    client = _RecordedPages([RECORDED["compute_instance_response"], RECORDED["storage_response"]])
    source = OnDemandPrices("us-east-1", bundled_catalog(), client=client)
    with capture_logs() as logs:
        prices = await source.prices([G5], now=0.0)
    assert prices[G5].on_demand == 1.006 and source.sources["g5.xlarge"] == PRICE_LIST_SOURCE
    assert client.asked[0]["ServiceCode"] == "AmazonEC2" and client.asked[0]["FormatVersion"] == "aws_v1"
    assert any(e["event"] == "price_list_entry_rejected" for e in logs)  # the storage item, logged
