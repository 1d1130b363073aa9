"""Must-show: the reconcile loop, through the real aiobotocore adapter, against moto server."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fleetd.adapters.ec2 import TAG_FLEET, TAG_JOB, TAG_LAUNCH, TAG_POOL
from fleetd.policy.model import Launch, Market, PoolId, Terminate
from fleetd.reconcile.loop import Reconciler
from tests.reconcile_support import BEST, SECOND_BEST, Cloud, FakeClock, built_reconciler, pools_of


@contextlib.asynccontextmanager
async def reconciler(cloud: Cloud, state_dir: Path, clock: FakeClock, **cfg_kw) -> AsyncIterator[Reconciler]:
    async with built_reconciler(cloud, cloud.config(state_dir, **cfg_kw), clock) as r:
        yield r


async def converge(r: Reconciler, clock: FakeClock, passes: int = 4) -> list:
    reports = []
    for _ in range(passes):
        reports.append(await r.run_pass())
        clock.advance(r.cfg.fleet.reconcile_interval_s)
    return reports


def actions(reports, kind) -> list:
    return [o for rep in reports for o in rep.outcomes if isinstance(o.action, kind)]


async def test_fleet_of_three_converges_is_repaired_and_scales_down(cloud: Cloud, tmp_path: Path) -> None:
    clock = FakeClock(time.time())
    async with reconciler(cloud, tmp_path, clock) as r:
        reports = await converge(r, clock)
        live = await cloud.instances()
        assert len(live) == 3
        tags = [{t["Key"]: t["Value"] for t in i["Tags"]} for i in live]
        assert all(t[TAG_FLEET] == "t" and t[TAG_JOB] == "train" and t[TAG_LAUNCH].startswith("fleetd-") for t in tags)
        assert all(
            t[TAG_POOL] == f"{i['InstanceType']}@{i['Placement']['AvailabilityZone']}"
            for t, i in zip(tags, live, strict=True)
        )
        launches = actions(reports, Launch)
        assert [o.status for o in launches] == ["done"]  # one CreateFleet bought all three
        launch = launches[0].action
        assert launch.market is Market.SPOT and launch.count == 3
        # Pools are every configured (type, zone); the launch ranks them, lowest expected cost
        # first, diversified over pools near the best score, and sends them all as overrides of one
        # CreateFleet.
        assert set(r.pools) == {
            PoolId(t, z) for t in ("g5.xlarge", "g4dn.xlarge") for z in ("us-east-1a", "us-east-1b")
        }
        assert launch.pools[0] == BEST
        # One synchronous job trains in one zone: pools elsewhere carry the cross-AZ penalty, which
        # puts them beyond diversify_within of the best, so the launch stays in the best pool's zone.
        assert {p.zone for p in launch.pools} == {BEST.zone}
        assert "expected cost per useful GPU-hour" in launch.reason
        request = cloud.proxy.calls_of("CreateFleet")[0]
        assert request["Type"] == "instant"
        assert request["SpotOptions.AllocationStrategy"] == "price-capacity-optimized"
        overrides = [
            PoolId(
                request[f"LaunchTemplateConfigs.1.Overrides.{n}.InstanceType"],
                {v: k for k, v in cloud.subnets.items()}[request[f"LaunchTemplateConfigs.1.Overrides.{n}.SubnetId"]],
            )
            for n in range(1, len(launch.pools) + 1)
        ]
        assert overrides == list(launch.pools)
        assert set(pools_of(live)) <= set(launch.pools)
        # Later passes hold: no second purchase once EC2 shows three.
        assert len(cloud.proxy.calls_of("CreateFleet")) == 1

        # AWS takes one away: the next pass replaces it (and counts a loss for its pool).
        victim = live[0]["InstanceId"]
        await cloud.terminate_directly(victim)
        reports = await converge(r, clock, passes=3)
        live = await cloud.instances()
        assert len(live) == 3 and victim not in {i["InstanceId"] for i in live}
        assert [o.action.count for o in actions(reports, Launch)] == [1]
        # Nobody asked for that termination and no notice came: a loss, learned for its pool.
        stats = await r.state.pool_stats()
        assert sum(s.losses for s in stats) == 1

    # Scale to 1 (a new config, the same state directory): two are terminated, by fleetd.
    async with reconciler(cloud, tmp_path, clock, nodes=1) as r:
        reports = await converge(r, clock, passes=3)
        terminated = actions(reports, Terminate)
        assert len(terminated) == 2 and all(o.status == "done" for o in terminated)
        assert all("scaling to 1" in o.action.reason for o in terminated)
        live = await cloud.instances()
        assert len(live) == 1
        rows = await r.state.instances(open_only=False)
        reasons = sorted(row.end_reason for row in rows if row.ended_at is not None)
        assert reasons.count("terminated by fleetd") == 2
        assert len([x for x in reasons if x.startswith("lost")]) == 1
        # fleetd's own terminations are not interruptions: still exactly one loss.
        assert sum(s.losses for s in await r.state.pool_stats()) == 1
        # State matches EC2: exactly the live instance is open in the DB.
        assert [row.instance_id for row in rows if row.open] == [live[0]["InstanceId"]]


async def test_capacity_errors_and_throttling_converge_elsewhere_and_pool_returns_after_ttl(
    cloud: Cloud, tmp_path: Path
) -> None:
    clock = FakeClock(time.time())
    async with reconciler(cloud, tmp_path, clock) as r:
        # 1. Throttled while observing: the pass ends early, nothing is bought, the loop backs off.
        cloud.proxy.fail("DescribeInstances", "RequestLimitExceeded")
        report = await r.run_pass()
        assert report.throttled and report.plan is None
        assert r.next_delay(report) > r.cfg.fleet.reconcile_interval_s
        # 2. Throttled on CreateFleet itself: the launch is settled as not bought, pass cut short.
        cloud.proxy.fail("CreateFleet", "RequestLimitExceeded")
        report = await r.run_pass()
        assert report.throttled and not await cloud.instances()
        assert [row.status for row in await r.state.launches()] == ["failed"]
        # 3. The two best-ranked pools have no spot capacity (real CreateFleet errorSet entries).
        cloud.proxy.fail("CreateFleet", "InsufficientInstanceCapacity", pool=BEST, times=None)
        cloud.proxy.fail("CreateFleet", "MaxSpotInstanceCountExceeded", pool=SECOND_BEST, times=None)
        reports = [await r.run_pass() for _ in range(3)]
        assert all(rep.error is None for rep in reports)
        live = await cloud.instances()
        assert len(live) == 3
        assert not {BEST, SECOND_BEST} & set(pools_of(live))
        stats = {s.pool: s for s in await r.state.pool_stats()}
        for pool in (BEST, SECOND_BEST):
            assert stats[pool].capacity_error_until == clock() + r.cfg.capacity.capacity_error_ttl_s
        assert ("CreateFleet", "InsufficientInstanceCapacity") in cloud.proxy.injected
        assert await r.state.get_meta("spot_unavailable_since") is None  # spot was found after all

        # 4. Capacity is back and the TTL has passed: a replacement joins the job where it trains
        # now, in the best pool of that zone again (the g5 type, no longer marked), and gets it.
        cloud.proxy.clear()
        clock.advance(r.cfg.capacity.capacity_error_ttl_s + 1)
        await cloud.terminate_directly(live[0]["InstanceId"])
        job_zones = {p.zone for p in pools_of(live[1:])}
        assert len(job_zones) == 1
        best_here = PoolId(BEST.instance_type, job_zones.pop())
        before = len(cloud.proxy.calls_of("CreateFleet"))
        await converge(r, clock, passes=2)
        request = cloud.proxy.calls_of("CreateFleet")[before]
        assert request["LaunchTemplateConfigs.1.Overrides.1.InstanceType"] == best_here.instance_type
        assert request["LaunchTemplateConfigs.1.Overrides.1.SubnetId"] == cloud.subnets[best_here.zone]
        live = await cloud.instances()
        assert len(live) == 3 and best_here in pools_of(live)
