"""Shared pieces of the provisioning tests: moto behind the fault proxy, a test config, a clock.

Prices take the production path: on-demand from ``pricing:GetProducts`` and spot from
``ec2:DescribeSpotPriceHistory``, both answered by the fault proxy in AWS's payload shapes
(fleetd/adapters/pricing_fake.py: the bundled catalog's list prices; spot prices set per pool
below). The configs set no ``price_book``.

Clients here make exactly one attempt (``total_max_attempts=1``): an injected fault must reach
the adapter, not be retried away by botocore.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from botocore.config import Config

from fleetd.adapters.catalog import bundled_catalog
from fleetd.adapters.ec2 import TAG_FLEET
from fleetd.adapters.faults import FaultProxy
from fleetd.adapters.pricing_fake import PriceListFake, SpotPriceFake
from fleetd.config import BudgetConfig, CapacityConfig, FleetConfig, FleetdConfig
from fleetd.policy.model import PoolId
from fleetd.shared.settings import AwsConfig

ONE_ATTEMPT = Config(retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=5, read_timeout=30)
ZONES = ("us-east-1a", "us-east-1b")
TYPES = ("g5.xlarge", "g4dn.xlarge")
# Spot prices the test cloud quotes for the test pools (typical of 2025; on-demand prices come
# from the catalog: g4dn.xlarge $0.526, g5.xlarge $1.006 in us-east-1). Placement ranks by expected
# cost per useful GPU-hour (the catalog's relative throughput: T4 0.33, A10G 1.0 per GPU), so the
# dearer g5 pools come first: g5.xlarge@us-east-1b ($0.3987/h for 1.0), g5.xlarge@us-east-1a
# ($0.4121), then g4dn.xlarge@us-east-1a ($0.2206 for 0.33 = $0.668 per A10G-hour), ...-1b.
SPOT = {
    PoolId("g4dn.xlarge", "us-east-1a"): 0.2206,
    PoolId("g4dn.xlarge", "us-east-1b"): 0.2341,
    PoolId("g5.xlarge", "us-east-1a"): 0.4121,
    PoolId("g5.xlarge", "us-east-1b"): 0.3987,
}
BEST = PoolId("g5.xlarge", "us-east-1b")
SECOND_BEST = PoolId("g5.xlarge", "us-east-1a")


@contextlib.asynccontextmanager
async def built_reconciler(cloud: Cloud, cfg: FleetdConfig, clock: FakeClock) -> AsyncIterator[Any]:
    """A real reconcile loop for ``cfg`` on the test cloud (through the fault proxy), closed after."""
    from fleetd.policy.planner import plan
    from fleetd.reconcile.build import build_reconciler

    async with cloud.client() as client, cloud.pricing_client() as pricing:
        built = await build_reconciler(cfg, client, planner=plan, clock=clock, pricing_client=pricing)
        try:
            yield built.reconciler
        finally:
            await built.close()


class FakeClock:
    """Starts at the real time (EC2 launch times are real) and only moves when told to."""

    def __init__(self, start: float):
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@dataclass
class Cloud:
    moto: str
    proxy: FaultProxy
    session: Any
    ami: str
    subnets: dict[str, str]  # zone -> subnet id
    extra: dict[str, Any] = field(default_factory=dict)

    def config(self, state_dir: Path, *, fleet: str = "t", nodes: int = 3, **capacity: Any) -> FleetdConfig:
        cap = dict(
            instance_types=TYPES,
            zones=ZONES,
            ami_id=self.ami,
            subnet_ids=tuple(self.subnets[z] for z in ZONES),
            capacity_error_ttl_s=120.0,
        )
        cap.update(capacity)
        return FleetdConfig(
            aws=AwsConfig(region="us-east-1", endpoint_url=self.proxy.url),
            fleet=FleetConfig(
                name=fleet, min_nodes=nodes, max_nodes=nodes, state_dir=state_dir, reconcile_interval_s=0.2
            ),
            capacity=CapacityConfig(**cap),
            budget=BudgetConfig(total_usd=10_000.0, max_usd_per_hour=100.0),
        )

    @contextlib.asynccontextmanager
    async def client(self, *, direct: bool = False) -> AsyncIterator[Any]:
        """An EC2 client through the fault proxy (``direct``: straight to moto, for checks)."""
        url = self.moto if direct else self.proxy.url
        async with self.session.create_client(
            "ec2", endpoint_url=url, region_name="us-east-1", config=ONE_ATTEMPT
        ) as c:
            yield c

    @contextlib.asynccontextmanager
    async def pricing_client(self) -> AsyncIterator[Any]:
        """A Price List API client; the fault proxy answers it (moto has no Pricing API)."""
        async with self.session.create_client(
            "pricing", endpoint_url=self.proxy.url, region_name="us-east-1", config=ONE_ATTEMPT
        ) as c:
            yield c

    async def instances(self, fleet: str = "t", states: tuple[str, ...] = ("pending", "running")) -> list[dict]:
        """What EC2 (moto) really holds for the fleet, bypassing the proxy."""
        async with self.client(direct=True) as c:
            resp = await c.describe_instances(
                Filters=[
                    {"Name": f"tag:{TAG_FLEET}", "Values": [fleet]},
                    {"Name": "instance-state-name", "Values": list(states)},
                ]
            )
        return [i for r in resp["Reservations"] for i in r["Instances"]]

    async def terminate_directly(self, instance_id: str) -> None:
        """As AWS does when it reclaims a spot node: fleetd is not asked."""
        async with self.client(direct=True) as c:
            await c.terminate_instances(InstanceIds=[instance_id])


async def make_cloud(moto_endpoint: str, session: Any) -> Cloud:
    async with session.create_client(
        "ec2", endpoint_url=moto_endpoint, region_name="us-east-1", config=ONE_ATTEMPT
    ) as c:
        subnets = (await c.describe_subnets())["Subnets"]
        # A name filter keeps moto from serialising its ~1,300 default images (seconds per test).
        named = {"Name": "name", "Values": ["amzn2-ami-hvm-2.0*"]}
        images = (await c.describe_images(Owners=["amazon"], Filters=[named]))["Images"]
        images = images or (await c.describe_images(Owners=["amazon"]))["Images"]
        ami = images[0]["ImageId"]
    by_zone = {}
    for s in subnets:
        if s.get("DefaultForAz"):
            by_zone[s["AvailabilityZone"]] = s["SubnetId"]
    catalog = bundled_catalog()
    spot = SpotPriceFake(catalog)
    for pool, price in SPOT.items():
        spot.set(pool, price)
    proxy = FaultProxy(
        moto_endpoint, {v: k for k, v in by_zone.items()}, price_list=PriceListFake(catalog), spot_prices=spot
    ).start()
    return Cloud(moto_endpoint, proxy, session, ami, by_zone)


def pools_of(instances: list[dict]) -> list[PoolId]:
    return sorted(PoolId(i["InstanceType"], i["Placement"]["AvailabilityZone"]) for i in instances)


import pytest  # noqa: E402  (fixtures below are imported by the test modules that use them)


@pytest.fixture
async def cloud(moto_endpoint: str, aio_session: Any) -> AsyncIterator[Cloud]:
    c = await make_cloud(moto_endpoint, aio_session)
    try:
        yield c
    finally:
        c.proxy.stop()
