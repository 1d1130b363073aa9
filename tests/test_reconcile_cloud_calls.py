"""While the loop runs, CreateFleet and TerminateInstances run in their own task (cloud_calls.py):
passes go on while EC2 holds a call open, nothing is bought or terminated twice, the answer is
recorded in the state DB, and a throttled call backs the loop off. Real planner, real state DB,
in-memory EC2 whose calls wait until released (as a slow call at fleet scale does)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from fleetd.adapters.aws_errors import Throttled
from fleetd.adapters.ec2 import LaunchSpec
from fleetd.adapters.ec2_fake import FakeEc2
from fleetd.adapters.pricing import FilePriceBook
from fleetd.config import BudgetConfig, CapacityConfig, FleetConfig, FleetdConfig
from fleetd.policy.model import Market, PoolId
from fleetd.policy.planner import plan
from fleetd.reconcile import state as st
from fleetd.reconcile.build import ledger_beside
from fleetd.reconcile.cloud_calls import CloudCalls, Job
from fleetd.reconcile.loop import PassReport, Reconciler
from fleetd.reconcile.state import StateStore
from tests.reconcile_support import FakeClock

BOOK = FilePriceBook.demo()
A = PoolId("g4dn.xlarge", "us-east-1a")
B = PoolId("g5.xlarge", "us-east-1a")


class HeldEc2(FakeEc2):
    """CreateFleet and TerminateInstances wait until released."""

    def __init__(self, clock) -> None:
        super().__init__(clock)
        self.release = asyncio.Event()
        self.release.set()
        self.in_call = asyncio.Event()
        self.entered: list[str] = []  # every call as it starts (FakeEc2.calls logs them as they end)

    async def launch(self, spec: LaunchSpec):
        self.entered.append("CreateFleet")
        self.in_call.set()
        await self.release.wait()
        return await super().launch(spec)

    async def terminate(self, instance_ids: Sequence[str]) -> list[str]:
        self.entered.append("TerminateInstances")
        self.in_call.set()
        await self.release.wait()
        return await super().terminate(instance_ids)


async def setup(tmp_path: Path, nodes: int, seed: int):
    clock = FakeClock(1_800_000_000.0)
    ec2 = HeldEc2(clock)
    await ec2.launch(LaunchSpec("seed", seed, Market.SPOT, (A,)))
    ec2.release.clear()
    cfg = FleetdConfig(
        fleet=FleetConfig(name="t", min_nodes=nodes, max_nodes=nodes, state_dir=tmp_path, reconcile_interval_s=10.0),
        capacity=CapacityConfig(instance_types=("g4dn.xlarge", "g5.xlarge"), zones=("us-east-1a",)),
        budget=BudgetConfig(total_usd=1e6, max_usd_per_hour=1e4),
    )
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
        ledger=await ledger_beside(state),
    )
    return r, ec2, state, clock


async def until(cond, tries: int = 500) -> None:
    for _ in range(tries):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_passes_go_on_while_a_launch_is_held_and_nothing_is_bought_twice(tmp_path: Path):
    r, ec2, state, clock = await setup(tmp_path, nodes=4, seed=3)
    wake = asyncio.Event()
    reports: list[PassReport] = []
    loop = asyncio.create_task(r.run(wake, on_pass=reports.append))
    try:
        await asyncio.wait_for(ec2.in_call.wait(), 10)  # the first pass bought the missing node
        await until(lambda: len(reports) >= 1)
        assert [o.status for o in reports[0].outcomes if type(o.action).__name__ == "Launch"] == ["started"]
        for _ in range(3):  # more passes while EC2 holds the CreateFleet open
            clock.advance(10)
            wake.set()
            seen = len(reports)
            await until(lambda n=seen: len(reports) > n)
        assert ec2.entered.count("CreateFleet") == 2  # the seed's and the held one: no second buy
        held = [o for rep in reports[1:] for o in rep.outcomes if type(o.action).__name__ == "Launch"]
        assert held and all(o.status == "held" for o in held)
        ec2.release.set()
        await until(lambda: len(ec2.live()) == 4)
        # Its answer is recorded (the intent settled, the instance known with its launch cap) and
        # the pass it woke sees a full fleet: nothing more is bought.
        await until(
            lambda: any(
                rep.plan is not None and not rep.plan.actions and len(rep.live_instances) == 4 for rep in reports
            )
        )
        launches = await state.launches()
        assert [row.status for row in launches] == [st.LAUNCHED]
        rows = {row.instance_id: row for row in await state.instances()}
        assert set(rows) == {i.instance_id for i in ec2.live()}
        new = [i.instance_id for i in ec2.live() if i.launch_token != "seed"]
        assert len(new) == 1 and rows[new[0]].max_price_per_hour is not None
        assert ec2.count("CreateFleet") == 2
    finally:
        ec2.release.set()
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await state.close()


async def test_a_termination_in_flight_is_not_asked_again(tmp_path: Path):
    r, ec2, state, clock = await setup(tmp_path, nodes=2, seed=4)  # two too many: scale in
    wake = asyncio.Event()
    reports: list[PassReport] = []
    loop = asyncio.create_task(r.run(wake, on_pass=reports.append))
    try:
        await asyncio.wait_for(ec2.in_call.wait(), 10)
        for _ in range(3):
            clock.advance(10)
            wake.set()
            seen = len(reports)
            await until(lambda n=seen: len(reports) > n)
        assert ec2.entered.count("TerminateInstances") == 1  # still inside the first call
        asked = [o for rep in reports for o in rep.outcomes if type(o.action).__name__ == "Terminate"]
        assert {o.status for o in asked} <= {"started", "held"}
        started = [o.action.instance_id for o in asked if o.status == "started"]
        assert len(started) == len(set(started)) == 2
        ec2.release.set()
        await until(lambda: len(ec2.live()) == 2)
        await asyncio.sleep(0.1)
        calls = [ids for op, ids in ec2.calls if op == "TerminateInstances"]
        assert sorted(i for ids in calls for i in ids) == sorted(started)
    finally:
        ec2.release.set()
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await state.close()


async def test_a_throttled_launch_in_its_task_backs_the_loop_off(tmp_path: Path):
    r, ec2, state, clock = await setup(tmp_path, nodes=4, seed=3)
    ec2.release.set()
    ec2.fail_next["CreateFleet"] = [Throttled("CreateFleet", "RequestLimitExceeded", "slow down")]
    reports: list[tuple[PassReport, float]] = []
    wake = asyncio.Event()
    loop = asyncio.create_task(r.run(wake, on_pass=lambda rep: reports.append((rep, r.next_delay(rep)))))
    try:
        # The first pass submits the launch; its job fails throttled and wakes the loop; the next
        # pass reports the throttling and the loop backs off (interval x 2 x jitter >= 10 s).
        await until(lambda: any(rep.throttled for rep, _ in reports))
        assert next(delay for rep, delay in reports if rep.throttled) >= 10.0
        assert [row.status for row in await state.launches()] == [st.FAILED]
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await state.close()


async def test_a_bounded_run_ends_with_its_calls_made(tmp_path: Path):
    r, ec2, state, clock = await setup(tmp_path, nodes=4, seed=3)
    ec2.release.set()
    try:
        await asyncio.wait_for(r.run(asyncio.Event(), passes=1), 10)
        assert len(ec2.live()) == 4
        assert [row.status for row in await state.launches()] == [st.LAUNCHED]
    finally:
        await state.close()


# -- the two lanes (CloudCalls alone: jobs are plain coroutines) --------------------------------


async def _lanes_until(cond, what: str) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not reached: {what}")


def _job(
    name: str,
    log: list[str],
    gate: asyncio.Event | None = None,
    *,
    launch: bool = False,
    fail: Exception | None = None,
    ids: frozenset[str] = frozenset(),
) -> Job:
    async def call() -> None:
        log.append(f"start {name}")
        if gate is not None:
            await gate.wait()
        if fail is not None:
            raise fail
        log.append(f"end {name}")

    return Job(name, call, instance_ids=ids, launch=launch, token=name if launch else "")


async def test_a_termination_never_waits_behind_a_held_launch() -> None:
    calls, log, held = CloudCalls(), [], asyncio.Event()
    worker = asyncio.create_task(calls.run())
    try:
        calls.submit(_job("launch", log, held, launch=True))
        await _lanes_until(lambda: "start launch" in log, "the launch on the wire")
        calls.submit(_job("terminate", log, ids=frozenset({"i-1"})))
        await _lanes_until(lambda: "end terminate" in log, "the termination done")
        assert "end launch" not in log and calls.launching and not calls.terminating("i-1")
        held.set()
        await asyncio.wait_for(calls.idle(), 5)
        assert log == ["start launch", "start terminate", "end terminate", "end launch"]
    finally:
        held.set()
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)


async def test_a_launch_waits_for_the_terminations_submitted_before_it_and_is_dropped_if_one_failed() -> None:
    calls, log, held = CloudCalls(), [], asyncio.Event()
    worker = asyncio.create_task(calls.run())
    try:
        calls.submit(_job("terminate", log, held, ids=frozenset({"i-1"})))
        calls.submit(_job("launch", log, launch=True))
        await _lanes_until(lambda: "start terminate" in log, "the termination on the wire")
        await asyncio.sleep(0.05)
        assert log == ["start terminate"]  # the launch waits for it (quota and budget freed first)
        held.set()
        await asyncio.wait_for(calls.idle(), 5)
        assert log == ["start terminate", "end terminate", "start launch", "end launch"]

        log.clear()
        held.clear()
        calls.submit(_job("terminate2", log, held, fail=Throttled("TerminateInstances", "RequestLimitExceeded", "x")))
        calls.submit(_job("launch2", log, launch=True))
        await _lanes_until(lambda: "start terminate2" in log, "the termination on the wire")
        held.set()
        await asyncio.wait_for(calls.idle(), 5)
        assert log == ["start terminate2"]  # planned from a view older than the failure: dropped
        assert isinstance(calls.take_error(), Throttled) and not calls.launching
    finally:
        held.set()
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
