"""Current spot prices are fetched on their own interval (capacity.spot_price_refresh_s) and reused
by the passes while fresh: a pass makes no DescribeSpotPriceHistory call then, and asks for the
price in force now, not hours of history. The clock is the reconciler's (a FakeClock here)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from fleetd.adapters.aws_errors import AwsError
from fleetd.adapters.spot_prices import LatestSpotPrices
from fleetd.config import CapacityConfig
from fleetd.policy.model import PoolId
from fleetd.policy.planner import plan
from fleetd.reconcile.build import build_reconciler
from tests.reconcile_support import SPOT, Cloud, FakeClock
from tests.test_pricing import FakeClient

A = PoolId("g5.xlarge", "us-east-1a")
B = PoolId("g5.xlarge", "us-east-1b")
SPOT_CALL = "DescribeSpotPriceHistory"


def test_the_refresh_interval_defaults_to_five_minutes() -> None:
    assert CapacityConfig(instance_types=("g5.xlarge",)).spot_price_refresh_s == 300.0


class FakePaginator:
    """DescribeSpotPriceHistory as botocore's paginator: ``prices`` per pool, dated ``now``;
    ``fail`` makes the next call raise."""

    def __init__(self, prices: dict[PoolId, float]):
        self.prices = prices
        self.calls: list[dict[str, Any]] = []
        self.fail: Exception | None = None

    def paginate(self, **params: Any) -> Any:
        self.calls.append(params)
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc
        items = [
            {"InstanceType": p.instance_type, "AvailabilityZone": p.zone, "SpotPrice": str(v), "Timestamp": 0.0}
            for p, v in self.prices.items()
        ]

        async def pages() -> Any:
            yield {"SpotPriceHistory": items}

        return pages()


async def test_prices_are_reused_while_fresh_and_fetched_again_after_the_ttl() -> None:
    pages = FakePaginator({A: 0.40, B: 0.30})
    source = LatestSpotPrices(FakeClient(pages), refresh_s=300.0)
    assert (await source.prices([A, B], 1000.0))[A].spot == 0.40
    pages.prices[A] = 0.90
    for now in (1000.0, 1100.0, 1299.9):  # inside the TTL: served from memory
        assert (await source.prices([A, B], now))[A].spot == 0.40
    assert len(pages.calls) == 1
    assert (await source.prices([A, B], 1300.0))[A].spot == 0.90  # TTL passed: one new fetch
    assert len(pages.calls) == 2


async def test_it_asks_for_the_price_in_force_now_not_a_window() -> None:
    pages = FakePaginator({A: 0.40})
    now = datetime(2026, 6, 1, 12, tzinfo=UTC).timestamp()
    await LatestSpotPrices(FakeClient(pages), page_size=50).prices([A, B, PoolId("g4dn.xlarge", "us-east-1b")], now)
    (params,) = pages.calls
    assert params["StartTime"] == datetime(2026, 6, 1, 12, tzinfo=UTC) and "EndTime" not in params
    assert params["InstanceTypes"] == ["g4dn.xlarge", "g5.xlarge"]
    assert params["Filters"] == [{"Name": "availability-zone", "Values": ["us-east-1a", "us-east-1b"]}]
    assert params["ProductDescriptions"] == ["Linux/UNIX"] and params["PaginationConfig"] == {"PageSize": 50}


async def test_a_pool_not_fetched_yet_is_fetched_at_once_and_a_clock_step_back_refetches() -> None:
    pages = FakePaginator({A: 0.40, B: 0.30})
    source = LatestSpotPrices(FakeClient(pages), refresh_s=300.0)
    assert set(await source.prices([A], 0.0)) == {A}
    assert set(await source.prices([A, B], 10.0)) == {A, B}  # B is new: fetched, with A
    assert set(await source.prices([B], 20.0)) == {B} and len(pages.calls) == 2
    await source.prices([A], 5.0)  # the clock went back: not trusted as fresh
    assert len(pages.calls) == 3


async def test_a_failed_fetch_raises_and_the_next_call_tries_again() -> None:
    pages = FakePaginator({A: 0.40})
    source = LatestSpotPrices(FakeClient(pages), refresh_s=300.0)
    await source.prices([A], 0.0)
    pages.fail = AwsError("DescribeSpotPriceHistory", "RequestLimitExceeded", "slow down")
    with pytest.raises(AwsError):
        await source.prices([A], 300.0)
    assert (await source.prices([A], 301.0))[A].spot == 0.40 and len(pages.calls) == 3


async def test_a_reconcile_pass_makes_no_spot_price_call_while_prices_are_fresh(cloud: Cloud, tmp_path: Path) -> None:
    """Production wiring (build_reconciler, the fault proxy answering in EC2's XML): the first pass
    fetches, later passes and the launches' bookkeeping reuse it; once the TTL has passed one pass
    fetches again, and sees the new price."""
    clock = FakeClock(time.time())
    cfg = cloud.config(tmp_path, nodes=1, spot_price_refresh_s=300.0)
    async with cloud.client() as client, cloud.pricing_client() as pricing:
        built = await build_reconciler(cfg, client, planner=plan, clock=clock, pricing_client=pricing)
        try:
            first = await built.reconciler.run_pass()
            assert first.error is None
            assert len(cloud.proxy.calls_of(SPOT_CALL)) == 1
            cloud.proxy.spot_prices.set(A, 0.123)  # type: ignore[union-attr]  # the market moves
            for _ in range(5):
                clock.advance(30.0)
                report = await built.reconciler.run_pass()
                assert report.error is None
                assert {o.pool: o.spot_price for o in report.observation.offers}[A] == SPOT[A]  # still cached
            assert len(cloud.proxy.calls_of(SPOT_CALL)) == 1  # no call while fresh
            clock.advance(300.0)
            report = await built.reconciler.run_pass()
            assert report.error is None
            assert len(cloud.proxy.calls_of(SPOT_CALL)) == 2  # refreshed once the TTL passed
            assert {o.pool: o.spot_price for o in report.observation.offers}[A] == 0.123
            (req,) = cloud.proxy.calls_of(SPOT_CALL)[1:]
            assert "EndTime" not in req  # the price in force, not a window of history
        finally:
            await built.close()
