"""A notice must not wait behind a pass that waits on EC2: the urgent pass drains it at once with
the real planner (in-memory EC2 whose CreateFleet is held open, real state DB and registry). And
the registry forgets instances an hour after they ended, the observation launches no instance carries."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fleetd.adapters.ec2 import LaunchSpec
from fleetd.adapters.ec2_fake import FakeEc2
from fleetd.adapters.pricing import FilePriceBook
from fleetd.config import BudgetConfig, CapacityConfig, FleetConfig, FleetdConfig
from fleetd.intake.events import InterruptionNotice
from fleetd.intake.registry import NodeRegistry
from fleetd.policy.model import Market, PoolId
from fleetd.policy.planner import plan
from fleetd.reconcile import observe
from fleetd.reconcile.build import ledger_beside
from fleetd.reconcile.loop import Reconciler
from fleetd.reconcile.state import StateStore
from tests.reconcile_support import FakeClock

BOOK = FilePriceBook.demo()
A = PoolId("g4dn.xlarge", "us-east-1a")
B = PoolId("g5.xlarge", "us-east-1a")


class Commander:
    def __init__(self) -> None:
        self.drained: list[str] = []

    async def request_checkpoint(self, deadline, reason) -> None:
        pass

    async def drain(self, instance_id, deadline, reason, msg_id=None) -> None:
        self.drained.append(instance_id)

    def node_state(self, instance_id):
        return None

    async def stop_job(self, reason) -> None:
        pass

    async def resume_job(self, reason) -> None:
        pass


class HeldLaunches(FakeEc2):
    """CreateFleet that waits until released, as a slow EC2 call at fleet scale does."""

    release: asyncio.Event
    entered: asyncio.Event

    async def launch(self, spec: LaunchSpec):
        self.entered.set()
        await self.release.wait()
        return await super().launch(spec)


async def setup(tmp_path: Path, nodes: int = 4):
    clock = FakeClock(1_800_000_000.0)
    ec2 = HeldLaunches(clock)
    ec2.release, ec2.entered = asyncio.Event(), asyncio.Event()
    ec2.release.set()
    await ec2.launch(LaunchSpec("seed", nodes - 1, Market.SPOT, (A,)))
    ec2.release.clear()
    cfg = FleetdConfig(
        fleet=FleetConfig(name="t", min_nodes=nodes, max_nodes=nodes, state_dir=tmp_path, reconcile_interval_s=10.0),
        capacity=CapacityConfig(instance_types=("g4dn.xlarge", "g5.xlarge"), zones=("us-east-1a",)),
        budget=BudgetConfig(total_usd=1e6, max_usd_per_hour=1e4),
    )
    registry = NodeRegistry(clock=clock)
    commander = Commander()
    state = await StateStore.open(tmp_path)
    r = Reconciler(
        cfg,
        ec2=ec2,
        prices=BOOK,
        state=state,
        pools=(A, B),
        hardware={t: BOOK.hardware(t) for t in ("g4dn.xlarge", "g5.xlarge")},
        planner=plan,
        clock=clock,
        observer=registry,
        commander=commander,
        ledger=await ledger_beside(state),
    )
    return r, ec2, registry, commander, clock, state


async def test_a_notice_during_a_held_launch_is_drained_before_the_launch_returns(tmp_path: Path):
    r, ec2, registry, commander, clock, state = await setup(tmp_path)
    wake = asyncio.Event()
    loop = asyncio.create_task(r.run(wake))
    try:
        # The fleet is one short: the first pass buys, and EC2 holds the CreateFleet open.
        await asyncio.wait_for(ec2.entered.wait(), 10)
        noticed = sorted(i.instance_id for i in ec2.live())[0]
        registry.apply(
            InterruptionNotice(noticed, "terminate", clock() + 120, "imds", received_at=clock(), dedup_key="n1")
        )
        wake.set()
        for _ in range(200):
            if commander.drained:
                break
            await asyncio.sleep(0.01)
        assert commander.drained == [noticed]
        assert not ec2.release.is_set()  # still inside the held pass
        ec2.release.set()
        for _ in range(200):  # the full pass after it does not drain the node again
            if ec2.count("CreateFleet") >= 1 and len(ec2.live()) >= 4:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert commander.drained == [noticed]
    finally:
        ec2.release.set()
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await state.close()


async def test_the_registry_forgets_an_instance_an_hour_after_it_ended(tmp_path: Path):
    r, ec2, registry, commander, clock, state = await setup(tmp_path, nodes=3)
    ec2.release.set()
    try:
        await r.run_pass()
        gone = sorted(i.instance_id for i in ec2.live())[0]
        ec2.interrupt(gone)
        clock.advance(10)
        await r.run_pass()
        assert registry.is_known(gone)
        clock.advance(observe.FORGET_AFTER_S + 1)
        await r.run_pass()
        assert not registry.is_known(gone)
        assert all(registry.is_known(i.instance_id) for i in ec2.live())
    finally:
        await state.close()


async def test_launch_purposes_are_kept_for_the_current_instances_only(tmp_path: Path):
    """Why each launch was bought is kept per launch token while an instance carries it; it grew
    by one entry per launch for as long as the daemon ran (bench/long_run.py found it)."""
    r, ec2, registry, commander, clock, state = await setup(tmp_path, nodes=3)
    ec2.release.set()
    try:
        await r.run_pass()  # 2 seed nodes (a token the state never recorded) + 1 bought
        clock.advance(10)
        await r.run_pass()
        bought = {i.launch_token for i in ec2.live()} - {"seed"}
        assert len(bought) == 1 and r._observation._purposes.keys() == {"seed", *bought}
        for inst in ec2.live():
            if inst.launch_token == "seed":
                ec2.interrupt(inst.instance_id)
        for _ in range(3):  # the replacements' launch, then a pass that sees them
            clock.advance(10)
            await r.run_pass()
        carried = {i.launch_token for i in ec2.live()}
        assert "seed" not in carried and r._observation._purposes.keys() == carried
    finally:
        await state.close()


class HeldListing(FakeEc2):
    """DescribeInstances that waits until released once ``hold`` is set (a slow listing)."""

    hold: bool = False
    release: asyncio.Event
    listing: asyncio.Event

    async def list_instances(self):
        if self.hold:
            self.listing.set()
            await self.release.wait()
        return await super().list_instances()


async def test_a_notice_that_wakes_an_idle_loop_is_drained_before_the_next_observation(tmp_path: Path):
    clock = FakeClock(1_800_000_000.0)
    ec2 = HeldListing(clock)
    ec2.release, ec2.listing = asyncio.Event(), asyncio.Event()
    await ec2.launch(LaunchSpec("seed", 3, Market.SPOT, (A,)))
    cfg = FleetdConfig(
        fleet=FleetConfig(name="t", min_nodes=3, max_nodes=3, state_dir=tmp_path, reconcile_interval_s=600.0),
        capacity=CapacityConfig(instance_types=("g4dn.xlarge", "g5.xlarge"), zones=("us-east-1a",)),
        budget=BudgetConfig(total_usd=1e6, max_usd_per_hour=1e4),
    )
    registry, commander = NodeRegistry(clock=clock), Commander()
    state = await StateStore.open(tmp_path)
    r = Reconciler(
        cfg,
        ec2=ec2,
        prices=BOOK,
        state=state,
        pools=(A, B),
        hardware={t: BOOK.hardware(t) for t in ("g4dn.xlarge", "g5.xlarge")},
        planner=plan,
        clock=clock,
        observer=registry,
        commander=commander,
        ledger=await ledger_beside(state),
    )
    wake = asyncio.Event()
    passes: list = []
    loop = asyncio.create_task(r.run(wake, on_pass=passes.append))
    try:
        for _ in range(500):  # the first pass, then the loop idles (600 s interval)
            if passes:
                break
            await asyncio.sleep(0.01)
        ec2.hold = True  # from now on an observation waits on EC2
        noticed = sorted(i.instance_id for i in ec2.live())[0]
        registry.apply(
            InterruptionNotice(noticed, "terminate", clock() + 120, "imds", received_at=clock(), dedup_key="n1")
        )
        wake.set()
        await asyncio.wait_for(ec2.listing.wait(), 10)  # the full pass after it is observing
        assert commander.drained == [noticed]  # drained before that observation returned
    finally:
        ec2.release.set()
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await state.close()
