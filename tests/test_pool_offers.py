"""No pool is dropped silently: every configured pool is offered to the planner or excluded with
a reason that is logged once and shows in status.json."""

from __future__ import annotations

import time
from pathlib import Path

from structlog.testing import capture_logs

from fleetd.adapters.pricing import Hardware, PoolPrice
from fleetd.policy.model import PoolId
from fleetd.policy.planner import plan
from fleetd.reconcile.build import build_reconciler
from fleetd.reconcile.pool_offers import ExclusionLog, pool_rows
from fleetd.snapshot import build_snapshot
from tests.reconcile_support import SPOT, Cloud, FakeClock

A = PoolId("g5.xlarge", "us-east-1a")
B = PoolId("g6.xlarge", "us-east-1a")
C = PoolId("x9.huge", "us-east-1a")
D = PoolId("g6f.large", "us-east-1a")
HW = {
    "g5.xlarge": Hardware(1, "A10G", 24, relative_throughput=1.0),
    "g6.xlarge": Hardware(1, "L4", 24, relative_throughput=0.9),
    "g6f.large": Hardware(0, "L4", 3),
}


def test_every_pool_is_offered_or_excluded_with_a_reason() -> None:
    prices = {A: PoolPrice(A, 0.4, 1.006, 0.01), B: PoolPrice(B, 0.3, None), D: PoolPrice(D, 0.1, 0.2)}
    rows = pool_rows([A, B, C, D], prices, HW)
    assert [r.pool for r in rows] == [A, B, C, D]
    by = {r.pool: r for r in rows}
    offer = by[A].offer
    assert offer is not None and offer.on_demand_price == 1.006 and offer.spot_price == 0.4
    assert offer.relative_throughput == 1.0 and offer.spot_price_trend == 0.01 and by[A].excluded is None
    assert by[B].offer is None and "no on-demand price for g6.xlarge in us-east-1" in by[B].excluded
    assert by[B].spot_price == 0.3  # what is known is still shown
    assert by[C].offer is None and "no hardware facts for x9.huge" in by[C].excluded
    assert by[D].offer is None and "no whole GPU" in by[D].excluded


def test_a_pool_with_spot_but_no_on_demand_price_is_excluded_and_one_without_spot_is_offered() -> None:
    rows = pool_rows([A, B], {A: PoolPrice(A, None, 1.006), B: PoolPrice(B, 0.3, None)}, HW)
    assert rows[0].offer is not None and rows[0].offer.spot_price is None  # on-demand only
    assert rows[1].offer is None


def test_exclusions_are_logged_once_and_the_return_once() -> None:
    journal = ExclusionLog()
    missing = pool_rows([A, B], {A: PoolPrice(A, 0.4, 1.0)}, HW)
    with capture_logs() as logs:
        for _ in range(5):
            journal.update(missing)
        journal.update(pool_rows([A, B], {A: PoolPrice(A, 0.4, 1.0), B: PoolPrice(B, 0.3, 0.8)}, HW))
        journal.update(missing)
    events = [(e["event"], e["pool"]) for e in logs]
    assert events == [("pool_excluded", str(B)), ("pool_included", str(B)), ("pool_excluded", str(B))]


def test_status_snapshot_lists_excluded_pools_with_their_reason() -> None:
    rows = pool_rows([A, B], {A: PoolPrice(A, 0.4, 1.0)}, HW)
    snap = build_snapshot(now=0.0, fleet="t", reconcile_interval_s=10, nodes=(), pools=rows)
    views = {v.pool: v for v in snap.pools}
    assert views[str(A)].offered and views[str(A)].gpu_model == "A10G" and views[str(A)].relative_throughput == 1.0
    assert not views[str(B)].offered and "no on-demand price" in views[str(B)].reason


async def test_reconciler_excludes_an_unpriced_pool_on_the_production_price_path(cloud: Cloud, tmp_path: Path) -> None:
    """p5e.48xlarge is sold through Capacity Blocks only: no on-demand price anywhere. Its pools
    are excluded with the reason; the others are priced by GetProducts + DescribeSpotPriceHistory."""
    clock = FakeClock(time.time())
    cfg = cloud.config(tmp_path, instance_types=("g5.xlarge", "g4dn.xlarge", "p5e.48xlarge"), nodes=1)
    async with cloud.client() as client, cloud.pricing_client() as pricing:
        built = await build_reconciler(cfg, client, planner=plan, clock=clock, pricing_client=pricing)
        try:
            with capture_logs() as logs:
                report = await built.reconciler.run_pass()
                await built.reconciler.run_pass()
            rows = built.reconciler.pool_rows
        finally:
            await built.close()
    assert report.error is None
    offered = {o.pool: o for o in report.observation.offers}
    assert set(offered) == set(SPOT)  # g5 and g4dn in both zones
    for pool, spot in SPOT.items():
        assert offered[pool].spot_price == spot
    assert offered[PoolId("g5.xlarge", "us-east-1a")].on_demand_price == 1.006
    assert offered[PoolId("g4dn.xlarge", "us-east-1a")].relative_throughput == 0.33
    excluded = {r.pool: r.excluded for r in rows if r.offer is None}
    assert set(excluded) == {PoolId("p5e.48xlarge", "us-east-1a"), PoolId("p5e.48xlarge", "us-east-1b")}
    assert all("no on-demand price for p5e.48xlarge in us-east-1" in why for why in excluded.values())
    said = [e for e in logs if e["event"] == "pool_excluded"]
    assert len(said) == 2  # once per pool over two passes
    assert cloud.proxy.calls_of("GetProducts") and cloud.proxy.calls_of("DescribeSpotPriceHistory")


def test_fleetd_status_shows_excluded_pools(tmp_path: Path) -> None:
    from fleetd.commands.status import collect, render
    from fleetd.snapshot import write_snapshot

    rows = pool_rows([A, B], {A: PoolPrice(A, 0.4, 1.0)}, HW)
    write_snapshot(tmp_path, build_snapshot(now=100.0, fleet="t", reconcile_interval_s=10, nodes=(), pools=rows))
    report = collect(tmp_path, now=101.0)
    assert [p["offered"] for p in report["pools"]] == [True, False]
    text = render(report)
    assert "pools: 1 offered, 1 excluded" in text and f"excluded {B}: no on-demand price" in text
