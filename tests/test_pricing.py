"""Price sources: the file price book (demo, tests, simulator) and EC2's spot price history."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from fleetd.adapters.pricing import (
    DEMO_PRICE_BOOK,
    Ec2SpotPriceSource,
    FilePriceBook,
    PriceBookError,
    slope_per_hour,
)
from fleetd.policy.model import PoolId
from tests.reconcile_support import SPOT, Cloud

A = PoolId("g5.xlarge", "us-east-1a")
B = PoolId("g5.xlarge", "us-east-1b")


async def test_demo_book_has_real_gpu_pools_with_spot_below_on_demand() -> None:
    book = FilePriceBook.demo()
    types = {p.instance_type for p in book.pools}
    assert types == {"g4dn.xlarge", "g5.xlarge", "g5.2xlarge", "g6.xlarge", "p3.2xlarge"}
    assert {p.zone for p in book.pools} == {"us-east-1a", "us-east-1b"}
    prices = await book.prices(book.pools, now=0.0)
    assert all(0 < p.spot < p.on_demand for p in prices.values())
    assert prices[PoolId("p3.2xlarge", "us-east-1a")].on_demand == 3.06
    assert book.hardware("g6.xlarge").gpu_model == "L4"
    assert await book.prices([PoolId("x9.huge", "us-east-1a")], 0.0) == {}


async def test_time_series_csv_gives_price_in_force_and_trend(tmp_path: Path) -> None:
    path = tmp_path / "book.csv"
    path.write_text(
        "instance_type,zone,on_demand,spot,t,gpus,gpu_model,gpu_memory_gib\n"
        "g5.xlarge,us-east-1a,1.006,0.40,0,1,A10G,24\n"
        "g5.xlarge,us-east-1a,1.006,0.46,3600,1,A10G,24\n"
        "g5.xlarge,us-east-1a,1.006,0.52,7200,1,A10G,24\n"
        "g5.xlarge,us-east-1b,1.006,0.30,0,1,A10G,24\n"
    )
    book = FilePriceBook.load(path, trend_window_s=3 * 3600)
    early = await book.prices([A, B], now=100.0)
    assert early[A].spot == 0.40 and early[B].spot == 0.30 and early[A].on_demand == 1.006
    late = (await book.prices([A], now=7300.0))[A]
    assert late.spot == 0.52
    assert late.trend == pytest.approx(0.06)  # +6 cents per hour
    assert (await book.prices([A], now=-50.0))[A].spot == 0.40  # before the first point: the first price
    assert book.hardware("g5.xlarge").gpu_memory_gib == 24


async def test_json_series_and_set_spot(tmp_path: Path) -> None:
    path = tmp_path / "book.json"
    path.write_text(
        json.dumps(
            {
                "pools": [
                    {
                        "instance_type": "g5.xlarge",
                        "zone": "us-east-1a",
                        "on_demand": 1.0,
                        "spot": [[0, 0.3], [600, 0.35]],
                    }
                ]
            }
        )
    )
    book = FilePriceBook.load(path)
    assert (await book.prices([A], 599.0))[A].spot == 0.3
    book.set_spot(A, 1200.0, 0.9)
    assert (await book.prices([A], 1300.0))[A].spot == 0.9


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("bad.json", "{not json", "not JSON"),
        ("nopools.json", json.dumps({"prices": []}), "'pools' list"),
        ("missing.json", json.dumps({"pools": [{"zone": "us-east-1a", "spot": 0.1}]}), "entry 1"),
        (
            "negative.json",
            json.dumps({"pools": [{"instance_type": "g5.xlarge", "zone": "a", "spot": -1}]}),
            "must be >= 0",
        ),
        ("nan.csv", "instance_type,zone,on_demand,spot\ng5.xlarge,us-east-1a,nan,0.1\n", "entry 1"),
    ],
)
def test_malformed_books_are_rejected_with_the_file_and_entry(tmp_path: Path, name: str, text: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(PriceBookError, match=match) as info:
        FilePriceBook.load(path)
    assert str(path) in str(info.value)


def test_missing_book_is_a_price_book_error(tmp_path: Path) -> None:
    with pytest.raises(PriceBookError, match="nope.json"):
        FilePriceBook.load(tmp_path / "nope.json")


def test_slope() -> None:
    assert slope_per_hour([(0, 1.0)]) == 0.0
    assert slope_per_hour([(0, 1.0), (1800, 1.5), (3600, 2.0)]) == pytest.approx(1.0)
    assert slope_per_hour([(5, 1.0), (5, 2.0)]) == 0.0


async def test_spot_history_request_shape_against_moto(cloud: Cloud) -> None:
    now = datetime(2026, 6, 1, 12, tzinfo=UTC).timestamp()
    async with cloud.client() as c:
        source = Ec2SpotPriceSource(c, on_demand=FilePriceBook.load(DEMO_PRICE_BOOK), window_s=3600, page_size=50)
        prices = await source.prices([A, B, PoolId("g4dn.xlarge", "us-east-1b")], now)
    (req,) = cloud.proxy.calls_of("DescribeSpotPriceHistory")
    assert (req["InstanceType.1"], req["InstanceType.2"]) == ("g4dn.xlarge", "g5.xlarge")
    assert req["ProductDescription.1"] == "Linux/UNIX"
    assert req["MaxResults"] == "50"
    assert req["StartTime"].startswith("2026-06-01T11:00:00") and req["EndTime"].startswith("2026-06-01T12:00:00")
    assert req["Filter.1.Name"] == "availability-zone"
    assert {req["Filter.1.Value.1"], req["Filter.1.Value.2"]} == {"us-east-1a", "us-east-1b"}
    # The test cloud answers the history in EC2's XML (moto's own answer is "0.00001" dated 2006):
    # spot from EC2, on-demand from the book.
    assert set(prices) == {A, B, PoolId("g4dn.xlarge", "us-east-1b")}
    assert prices[A].on_demand == 1.006 and prices[A].spot == SPOT[A] and prices[B].spot == SPOT[B]
    assert prices[A].trend == 0.0  # a flat series


class FakePaginator:
    def __init__(self, pages: list[list[dict]]):
        self.pages = pages
        self.params: dict | None = None

    def paginate(self, **params):
        self.params = params
        pages = self.pages

        async def gen():
            for page in pages:
                yield {"SpotPriceHistory": page}

        return gen()


class FakeClient:
    def __init__(self, paginator: FakePaginator):
        self.paginator = paginator

    def get_paginator(self, name: str) -> FakePaginator:
        assert name == "describe_spot_price_history"
        return self.paginator


def point(pool: PoolId, hour: float, price: float) -> dict:
    ts = datetime.fromtimestamp(hour * 3600, UTC)
    return {"InstanceType": pool.instance_type, "AvailabilityZone": pool.zone, "SpotPrice": f"{price}", "Timestamp": ts}


async def test_spot_history_across_pages_gives_newest_price_and_trend() -> None:
    other = PoolId("g5.xlarge", "us-east-1c")  # a zone nobody asked for
    # AWS returns newest first, spread over pages.
    pages = [
        [point(A, 3, 0.55), point(B, 3, 0.31), point(other, 3, 9.9)],
        [point(A, 2, 0.50), point(B, 2, 0.31)],
        [point(A, 1, 0.45)],
    ]
    source = Ec2SpotPriceSource(FakeClient(FakePaginator(pages)), window_s=6 * 3600)
    prices = await source.prices([A, B], now=3 * 3600 + 60)
    assert set(prices) == {A, B}
    assert prices[A].spot == 0.55 and prices[A].trend == pytest.approx(0.05)
    assert prices[B].spot == 0.31 and prices[B].trend == pytest.approx(0.0)
    assert prices[A].on_demand is None  # no on-demand source given


async def test_spot_history_pages_through_the_test_cloud(cloud: Cloud) -> None:
    """Two points per pool and two per page: the adapter follows EC2's NextToken to the end. The
    request is types x zones (6 pools, 12 points, 6 pages); only the wanted pools are kept."""
    now = datetime.now(UTC).timestamp()
    pools = [A, B, PoolId("g4dn.xlarge", "us-east-1a"), PoolId("g6.xlarge", "us-east-1a")]
    async with cloud.client() as c:
        history = await Ec2SpotPriceSource(c, window_s=3600, page_size=2).history(pools, now)
    calls = cloud.proxy.calls_of("DescribeSpotPriceHistory")
    assert len(calls) == 6 and sum(1 for c in calls if c.get("NextToken")) == 5
    assert {p: len(points) for p, points in history.items()} == {p: 2 for p in pools}
    assert history[A][-1][1] == SPOT[A]
    # A pool without a set quote: a share of the catalog's on-demand price, dated inside the window.
    g6 = history[PoolId("g6.xlarge", "us-east-1a")]
    assert 0.25 * 0.8048 < g6[-1][1] < 0.5 * 0.8048 and all(now - 3600 <= t <= now for t, _ in g6)
