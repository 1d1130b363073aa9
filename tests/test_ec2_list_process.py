"""The EC2 view's listing process (fleetd/adapters/ec2_list_process.py) against moto server
through the fault proxy: the same instances as the async adapter, AWS errors arrive as the
same classes, a dead child is replaced, and close() does not wait behind a listing."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from fleetd.adapters.aws_errors import PermanentAwsError, TransientAwsError
from fleetd.adapters.ec2 import TAG_FLEET, AioEc2
from fleetd.adapters.ec2_list_process import ProcessLister
from tests.harness.moto import NO_RETRIES
from tests.reconcile_support import Cloud


async def run_instances(cloud: Cloud, fleet: str, count: int) -> None:
    async with cloud.client(direct=True) as c:
        await c.run_instances(
            ImageId=cloud.ami,
            MinCount=count,
            MaxCount=count,
            InstanceType="g4dn.xlarge",
            TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": TAG_FLEET, "Value": fleet}]}],
        )


def lister_for(cloud: Cloud, fleet: str = "t") -> ProcessLister:
    kwargs = {"endpoint_url": cloud.proxy.url, "region_name": "us-east-1", "config": NO_RETRIES}
    return ProcessLister(kwargs, None, fleet)


async def test_lists_the_fleets_instances_like_the_async_adapter(cloud: Cloud) -> None:
    await run_instances(cloud, "t", 3)
    await run_instances(cloud, "other", 2)
    lister = lister_for(cloud)
    try:
        got = await asyncio.to_thread(lister)
        async with cloud.client() as c:
            expected = await AioEc2(c, fleet="t", job="").list_instances()
        assert sorted(got, key=lambda i: i.instance_id) == sorted(expected, key=lambda i: i.instance_id)
        assert len(got) == 3
        again = await asyncio.to_thread(lister)  # the same child answers again
        assert {i.instance_id for i in again} == {i.instance_id for i in got}
    finally:
        lister.close()


async def test_an_aws_error_arrives_as_its_class(cloud: Cloud) -> None:
    lister = lister_for(cloud)
    cloud.proxy.fail("DescribeInstances", "UnauthorizedOperation", times=None)
    try:
        with pytest.raises(PermanentAwsError) as err:
            await asyncio.to_thread(lister)
        assert (err.value.operation, err.value.code) == ("DescribeInstances", "UnauthorizedOperation")
        cloud.proxy.clear()
        assert await asyncio.to_thread(lister) == []  # the child survived the error
    finally:
        lister.close()


async def test_a_killed_child_is_replaced_on_the_next_listing(cloud: Cloud) -> None:
    await run_instances(cloud, "t", 1)
    lister = lister_for(cloud)
    try:
        assert len(await asyncio.to_thread(lister)) == 1
        first = lister._proc.pid
        os.kill(first, signal.SIGKILL)  # an OOM kill of the child
        await asyncio.to_thread(lister._proc.join, 10)
        assert len(await asyncio.to_thread(lister)) == 1
        assert lister._proc.pid != first
    finally:
        lister.close()


async def test_close_does_not_wait_behind_a_listing_in_flight(cloud: Cloud) -> None:
    lister = lister_for(cloud)
    assert await asyncio.to_thread(lister) == []  # the child is up
    held = cloud.proxy.hold("DescribeInstances")  # AWS does not answer
    outcome: list[BaseException | list] = []

    def listing() -> None:
        try:
            outcome.append(lister())
        except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
            outcome.append(exc)

    t = threading.Thread(target=listing)
    t.start()
    await asyncio.sleep(0.5)
    started = time.monotonic()
    await asyncio.to_thread(lister.close)
    assert time.monotonic() - started < 5
    await asyncio.to_thread(t.join, 10)
    held.release.set()
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], TransientAwsError)
    with pytest.raises(TransientAwsError, match="stopping"):
        lister()  # closed for good: no new child
    assert lister._proc is None
