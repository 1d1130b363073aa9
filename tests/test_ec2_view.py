"""Ec2View: the pass's EC2 listing served from the refresher, with fleetd's own writes laid over it."""

from __future__ import annotations

import asyncio

import pytest

from fleetd.adapters.aws_errors import AwsError
from fleetd.adapters.ec2 import LaunchSpec
from fleetd.adapters.ec2_fake import FakeEc2
from fleetd.adapters.ec2_view import Ec2View
from fleetd.policy.model import Market, PoolId

POOL = PoolId("g5.xlarge", "us-east-1a")


class Mono:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def view_of(ec2: FakeEc2, mono: Mono) -> Ec2View:
    v = Ec2View(ec2, refresh_s=1.0, max_age_s=10.0, clock=lambda: 5000.0, monotonic=mono)
    v._running = True  # as while the daemon runs its refresher (driven by hand here)
    return v


async def test_without_refresher_every_listing_describes():
    ec2 = FakeEc2(lambda: 1000.0)
    v = Ec2View(ec2, refresh_s=1.0, max_age_s=10.0)
    await v.list_instances()
    await v.list_instances()
    assert ec2.count("DescribeInstances") == 2


async def test_launched_and_terminated_show_before_the_next_listing_and_go_with_it():
    ec2, mono = FakeEc2(lambda: 1000.0), Mono()
    await ec2.launch(LaunchSpec("seed", 2, Market.SPOT, (POOL,)))
    v = view_of(ec2, mono)
    await v.refresh()
    first = {i.instance_id for i in await v.list_instances()}
    assert len(first) == 2 and ec2.count("DescribeInstances") == 1
    mono.t += 1
    got = await v.launch(LaunchSpec("more", 1, Market.SPOT, (POOL,)))
    gone = sorted(first)[0]
    assert await v.terminate([gone]) == [gone]
    listed = {i.instance_id: i for i in await v.list_instances()}
    assert ec2.count("DescribeInstances") == 1  # served from the view
    assert got.instances[0].instance_id in listed  # read-your-writes: no double buy
    assert listed[gone].state == "shutting-down" and listed[gone].ended_at == 5000.0
    # A listing that began after the writes replaces the overlay with EC2's own word.
    mono.t += 1
    await v.refresh()
    listed = {i.instance_id: i for i in await v.list_instances()}
    assert listed[gone].state == "terminated" and len(listed) == 3
    assert v._launched == {} and v._terminated == {}


async def test_a_listing_that_began_before_a_write_keeps_the_write():
    ec2, mono = FakeEc2(lambda: 1000.0), Mono()
    v = view_of(ec2, mono)
    await v.refresh()
    started = asyncio.Event()
    release = asyncio.Event()
    inner_list = ec2.list_instances

    async def slow_list():
        snapshot = await inner_list()  # EC2 answers as of the call's start
        started.set()
        await release.wait()
        return snapshot

    ec2.list_instances = slow_list  # type: ignore[method-assign]
    task = asyncio.create_task(v.refresh())
    await started.wait()
    mono.t += 1
    got = await v.launch(LaunchSpec("late", 1, Market.SPOT, (POOL,)))
    release.set()
    await task
    ids = {i.instance_id for i in await v.list_instances()}
    assert got.instances[0].instance_id in ids


async def test_a_stale_listing_raises_the_refreshers_error():
    ec2, mono = FakeEc2(lambda: 1000.0), Mono()
    v = view_of(ec2, mono)
    await v.refresh()
    ec2.fail_next["DescribeInstances"] = [AwsError("DescribeInstances", "RequestLimitExceeded", "slow down")]
    with pytest.raises(AwsError):
        await v.refresh()
    assert await v.list_instances() is not None  # still fresh enough: served
    mono.t += 11
    with pytest.raises(AwsError):
        await v.list_instances()


async def test_a_malformed_answer_is_a_failed_listing_and_the_refresher_goes_on():
    """A 500 whose body botocore cannot parse (seen from a loaded moto) once escaped the refresher
    and ended the daemon's task group."""
    ec2, mono = FakeEc2(lambda: 1000.0), Mono()
    answers = iter([ValueError("not well-formed (invalid token): line 1, column 0"), KeyError("InstanceId")])

    def lister():
        for exc in answers:
            raise exc
        return []

    v = Ec2View(ec2, refresh_s=0.01, max_age_s=10.0, clock=lambda: 5000.0, monotonic=mono, lister=lister)
    with pytest.raises(AwsError) as err:
        await v.refresh()
    assert err.value.kind == "transient" and "not well-formed" in err.value.message
    refresher = asyncio.create_task(v.run())
    try:
        for _ in range(200):  # the refresher survives and the next listing succeeds
            if v._listing is not None:
                break
            await asyncio.sleep(0.01)
        assert v._listing == {} and not refresher.done()
    finally:
        refresher.cancel()


async def test_after_a_takeover_no_listing_from_before_it_is_served():
    """Another leader launched while this host's listing was on the wire (or while this host was
    frozen): that listing does not show the launch, and no overlay here has it. After
    ``distrust_before_now`` (what taking the lease calls) the pass waits for a listing that began
    later, instead of ending the other leader's nodes as lost and buying them again."""
    ec2, mono = FakeEc2(lambda: 1000.0), Mono()
    v = view_of(ec2, mono)
    await v.refresh()
    started, release = asyncio.Event(), asyncio.Event()
    inner_list = ec2.list_instances

    async def slow_list():
        snapshot = await inner_list()
        started.set()
        await release.wait()
        return snapshot

    ec2.list_instances = slow_list  # type: ignore[method-assign]
    old = asyncio.create_task(v.refresh())  # this host's refresher, mid-listing
    await started.wait()
    await ec2.launch(LaunchSpec("other-leader", 2, Market.SPOT, (POOL,)))  # not through this view
    mono.t += 1
    v.distrust_before_now()  # this host takes the lease
    ec2.list_instances = inner_list  # type: ignore[method-assign]
    listing = asyncio.create_task(v.list_instances())
    await asyncio.sleep(0.05)
    assert not listing.done()  # not served from the listing in flight, nor from the last one
    release.set()
    await old
    assert len(await asyncio.wait_for(listing, 5)) == 2  # a listing begun after the takeover
    assert ec2.count("DescribeInstances") == 3


class HeldDescribe(FakeEc2):
    """DescribeInstances that waits until released once ``hold`` is set."""

    hold = False

    async def list_instances(self):
        if self.hold:
            self.on_wire.set()
            await self.release.wait()
        return await super().list_instances()


async def test_a_stale_listing_is_served_while_a_describe_that_is_not_overdue_is_on_the_wire():
    """The refresher is slow, not failing: the pass gets the newest listing at once instead of
    waiting for the rest of the describe (3.2 s at 2,000 instances on moto). A describe that is
    itself overdue is waited for, as before."""
    ec2, mono = HeldDescribe(lambda: 1000.0), Mono()
    ec2.on_wire, ec2.release = asyncio.Event(), asyncio.Event()
    await ec2.launch(LaunchSpec("t", 2, Market.SPOT, (POOL,)))
    v = view_of(ec2, mono)
    await v.refresh()
    ec2.hold = True
    mono.t += 8
    slow = asyncio.create_task(v.refresh())  # the refresher's next describe, held on the wire
    await asyncio.wait_for(ec2.on_wire.wait(), 5)
    mono.t += 5  # the listing is 13 s old (max age 10 s); the describe on the wire 5 s
    assert len(await asyncio.wait_for(v.list_instances(), 1)) == 2  # served, not waited
    mono.t += 6  # now the describe on the wire is 11 s old: overdue
    waiting = asyncio.create_task(v.list_instances())
    await asyncio.sleep(0.05)
    assert not waiting.done()  # a stuck describe is waited for
    ec2.release.set()
    assert len(await asyncio.wait_for(waiting, 5)) == 2
    await slow
