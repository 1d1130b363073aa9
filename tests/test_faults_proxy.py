"""The fault proxy answers like AWS: botocore parses its payloads into the same errors and
CreateFleet results a real failure would give, and the adapter turns them into project errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from fleetd.adapters.aws_errors import CapacityUnavailable, PermanentAwsError, Throttled, translate
from fleetd.adapters.ec2 import AioEc2, LaunchSpec
from fleetd.adapters.ec2_pools import subnets_by_zone
from fleetd.adapters.launch_template import ensure_launch_template
from fleetd.policy.model import Market, PoolId
from tests.reconcile_support import Cloud

A = PoolId("g4dn.xlarge", "us-east-1a")
B = PoolId("g5.xlarge", "us-east-1b")


async def ec2_adapter(cloud: Cloud, client, tmp_path: Path) -> AioEc2:
    cfg = cloud.config(tmp_path)
    return AioEc2(
        client,
        fleet="t",
        job="train",
        template=await ensure_launch_template(client, cfg),
        subnets_by_zone=await subnets_by_zone(client, cfg.capacity.subnet_ids),
    )


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("RequestLimitExceeded", 503, Throttled),
        ("UnauthorizedOperation", 403, PermanentAwsError),
        ("InsufficientInstanceCapacity", 500, CapacityUnavailable),
    ],
)
async def test_call_level_faults_parse_as_aws_errors(cloud: Cloud, code: str, status: int, kind: type) -> None:
    cloud.proxy.fail("DescribeInstances", code, times=2)
    async with cloud.client() as c:
        for _ in range(2):
            with pytest.raises(ClientError) as info:
                await c.describe_instances()
            assert info.value.response["Error"]["Code"] == code
            assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
            assert isinstance(translate(info.value, "DescribeInstances"), kind)
        await c.describe_instances()  # the rule is spent: passed through to moto
    assert cloud.proxy.injected == [("DescribeInstances", code)] * 2


async def test_per_pool_capacity_errors_come_back_in_the_error_set(cloud: Cloud, tmp_path: Path) -> None:
    cloud.proxy.fail("CreateFleet", "InsufficientInstanceCapacity", pool=A)
    async with cloud.client() as c:
        ec2 = await ec2_adapter(cloud, c, tmp_path)
        partial = await ec2.launch(LaunchSpec("tok-1", 2, Market.SPOT, (A, B)))
        cloud.proxy.fail("CreateFleet", "InsufficientInstanceCapacity", pool=A)
        cloud.proxy.fail("CreateFleet", "SpotMaxPriceTooLow", pool=B)
        nothing = await ec2.launch(LaunchSpec("tok-2", 1, Market.SPOT, (A, B), max_price_per_hour=0.01))
    assert [i.pool for i in partial.instances] == [B, B]
    assert [(f.pool, f.kind, f.code) for f in partial.failures] == [(A, "capacity", "InsufficientInstanceCapacity")]
    assert "g4dn.xlarge capacity in the Availability Zone you requested (us-east-1a)" in partial.failures[0].message
    assert nothing.instances == ()
    assert [(f.pool, f.code) for f in nothing.failures] == [
        (A, "InsufficientInstanceCapacity"),
        (B, "SpotMaxPriceTooLow"),
    ]
    assert "0.0100" in nothing.failures[1].message  # the bid from the request, as AWS quotes it
    assert len(await cloud.instances()) == 2  # the all-failed request never reached moto


async def test_call_level_capacity_error_on_create_fleet(cloud: Cloud, tmp_path: Path) -> None:
    cloud.proxy.fail("CreateFleet", "InsufficientInstanceCapacity")
    async with cloud.client() as c:
        ec2 = await ec2_adapter(cloud, c, tmp_path)
        with pytest.raises(CapacityUnavailable) as info:
            await ec2.launch(LaunchSpec("tok-3", 1, Market.SPOT, (A,)))
    assert info.value.operation == "CreateFleet" and info.value.code == "InsufficientInstanceCapacity"


async def test_held_answer_arrives_after_ec2_acted(cloud: Cloud, tmp_path: Path) -> None:
    async with cloud.client() as c:
        ec2 = await ec2_adapter(cloud, c, tmp_path)
        hold = cloud.proxy.hold("CreateFleet")
        task = asyncio.create_task(ec2.launch(LaunchSpec("tok-4", 1, Market.SPOT, (A,))))
        assert await asyncio.to_thread(hold.arrived.wait, 10)
        assert len(await cloud.instances()) == 1 and not task.done()
        hold.release.set()
        result = await task
    assert [i.pool for i in result.instances] == [A]
