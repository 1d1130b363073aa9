"""`fleetd run`: the daemon's TaskGroup, its components, shutdown, and --dry-run."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from fleetd.daemon import DaemonContext, Plugins, run_daemon
from fleetd.policy.model import PoolId
from fleetd.policy.planner import plan
from fleetd.shared.settings import AwsConfig
from tests.reconcile_support import Cloud
from tests.test_reconcile_crash import log_events, write_config


def daemon_config(cloud: Cloud, tmp_path: Path):
    cfg = cloud.config(tmp_path / "state")
    return cfg.model_copy(update={"aws": AwsConfig(endpoint_url=cloud.proxy.url)})


async def test_components_run_beside_the_loop_and_can_wake_it(cloud: Cloud, tmp_path: Path) -> None:
    cfg = daemon_config(cloud, tmp_path)
    cfg = cfg.model_copy(update={"fleet": cfg.fleet.model_copy(update={"reconcile_interval_s": 3600.0})})
    ctx = DaemonContext(cfg)
    seen: list[int] = []

    async def intake(c: DaemonContext) -> None:
        # Waits for the first pass, then wakes the loop the way an urgent notice would.
        while c.last_report is None:
            await asyncio.sleep(0.05)
        seen.append(1)
        c.wake_loop()
        while True:
            await asyncio.sleep(3600)

    # Two passes with an hour between them: only the wake-up makes the second one happen now.
    status = await asyncio.wait_for(
        run_daemon(cfg, planner=plan, plugins=Plugins(components=[intake]), passes=2, ctx=ctx), 20
    )
    assert status == 0 and seen == [1]
    assert len(await cloud.instances()) == 3


async def test_a_component_that_ignores_cancellation_cannot_hold_shutdown(cloud: Cloud, tmp_path: Path) -> None:
    cfg = daemon_config(cloud, tmp_path)
    ctx = DaemonContext(cfg)

    async def stubborn(c: DaemonContext) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            # A clean-up far slower than the shutdown bound (shielded from the cancellation).
            await asyncio.shield(asyncio.sleep(4))

    task = asyncio.create_task(
        run_daemon(cfg, planner=plan, plugins=Plugins(components=[stubborn]), ctx=ctx, shutdown_timeout_s=1.0)
    )
    while ctx.last_report is None:
        await asyncio.sleep(0.05)
    ctx.stopping.set()  # what SIGTERM does
    started = asyncio.get_running_loop().time()
    assert await asyncio.wait_for(task, 30) == 1  # bounded: gave up after 1 s, reported failure
    assert asyncio.get_running_loop().time() - started < 3.5
    # Leave no stray task behind for the rest of the session.
    leftovers = [t for t in asyncio.all_tasks() if t.get_name() == "stubborn"]
    await asyncio.wait(leftovers, timeout=10)
    assert all(t.done() for t in leftovers)


async def test_a_crashing_component_ends_the_daemon_with_failure(cloud: Cloud, tmp_path: Path) -> None:
    cfg = daemon_config(cloud, tmp_path)

    async def broken(c: DaemonContext) -> None:
        raise RuntimeError("component bug")

    assert await asyncio.wait_for(run_daemon(cfg, planner=plan, plugins=Plugins(components=[broken])), 30) == 1


async def test_dry_run_plans_and_logs_without_side_effects(cloud: Cloud, tmp_path: Path) -> None:
    config = write_config(cloud, tmp_path)
    log = tmp_path / "dry.log"
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "fleetd.cli", "run", "--config", str(config), "--dry-run", "--passes", "2"],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        timeout=60,
    )
    assert proc.returncode == 0, log.read_text()
    assert "action" in log_events(log) and '"outcome": "dry-run"' in log.read_text()
    assert not cloud.proxy.calls_of("CreateFleet") and not cloud.proxy.calls_of("CreateLaunchTemplate")
    assert not await cloud.instances()
    assert not (tmp_path / "state" / "fleetd.db").exists()


async def test_bad_config_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[fleet]\nmin_nodes = 5\nmax_nodes = 2\n[capacity]\ninstance_types = ['g5.xlarge']\n")
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "fleetd.cli", "run", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "min_nodes" in proc.stderr and "Traceback" not in proc.stderr


async def test_startup_without_permission_waits_instead_of_crash_looping(
    cloud: Cloud, tmp_path: Path, monkeypatch
) -> None:
    from structlog.testing import capture_logs

    import fleetd.daemon as daemon_mod

    monkeypatch.setattr(daemon_mod, "STARTUP_RETRY_FIRST_S", 0.05)
    cfg = daemon_config(cloud, tmp_path)
    cloud.proxy.fail("DescribeLaunchTemplates", "UnauthorizedOperation", times=None)
    with capture_logs() as logs:
        task = asyncio.create_task(run_daemon(cfg, planner=plan, passes=1))
        while len(cloud.proxy.calls_of("DescribeLaunchTemplates")) < 4:  # retried, with backoff
            assert not task.done()
            await asyncio.sleep(0.05)
        cloud.proxy.clear()  # the operator fixes the IAM policy
        assert await asyncio.wait_for(task, 60) == 0
    blocked = [e for e in logs if e["event"] == "startup_blocked"]
    assert len(blocked) == 1 and blocked[0]["code"] == "UnauthorizedOperation"  # one clear line
    assert len(await cloud.instances()) == 3


async def test_daemon_prices_pools_on_the_production_path_and_status_shows_them(cloud: Cloud, tmp_path: Path) -> None:
    """`run_daemon` as `fleetd run` wires it, no price book: on-demand prices from the Price List
    API (GetProducts, served by the test cloud in AWS's shape), spot prices from
    DescribeSpotPriceHistory; status.json lists every pool with its prices, or why it is out."""
    from fleetd.adapters.catalog import bundled_catalog
    from fleetd.publish import status_component
    from fleetd.snapshot import read_snapshot
    from tests.reconcile_support import SPOT

    cfg = daemon_config(cloud, tmp_path)
    cfg = cfg.model_copy(
        update={
            "capacity": cfg.capacity.model_copy(update={"instance_types": ("g5.xlarge", "g4dn.xlarge", "p5e.48xlarge")})
        }
    )
    assert cfg.capacity.price_book is None and cfg.capacity.on_demand_prices == "price-list"
    ctx = DaemonContext(cfg)
    daemon = asyncio.create_task(
        run_daemon(
            cfg,
            planner=plan,
            ctx=ctx,
            session=cloud.session,
            plugins=Plugins(components=[status_component(watch_rendezvous=False, port=0)]),
        )
    )
    snap = None
    try:
        for _ in range(600):
            assert not daemon.done(), daemon.exception() if daemon.done() else None
            snap = read_snapshot(cfg.fleet.state_dir)
            if snap is not None and snap.pools and len(snap.live_nodes) == 3:
                break
            await asyncio.sleep(0.1)
    finally:
        ctx.stopping.set()
        assert await asyncio.wait_for(daemon, 30) == 0
    assert snap is not None and len(snap.live_nodes) == 3
    views = {v.pool: v for v in snap.pools}
    catalog = bundled_catalog()
    for pool, spot in SPOT.items():
        v = views[str(pool)]
        assert v.offered and v.spot_price == spot
        assert v.on_demand_price == catalog.on_demand(pool.instance_type, "us-east-1")
    for zone in ("us-east-1a", "us-east-1b"):
        v = views[f"p5e.48xlarge@{zone}"]
        assert not v.offered and "no on-demand price" in v.reason
    # Nodes were bought at the prices the cloud quoted, on the cheapest pools (g4dn spot).
    assert {n.pool for n in snap.live_nodes} <= {str(p) for p in SPOT}
    assert all(n.price_per_hour == SPOT[PoolId.parse(n.pool)] for n in snap.live_nodes)
    gets = cloud.proxy.calls_of("GetProducts")
    assert {c["Filters"][0]["Value"] for c in gets} >= {"g5.xlarge", "g4dn.xlarge"}
    assert cloud.proxy.calls_of("DescribeSpotPriceHistory")
