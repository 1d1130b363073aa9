"""Which pass next when the loop is woken (fleetd/reconcile/pass_schedule.py): notices that arrive
while an urgent pass runs fold into ONE following urgent pass, and a running full pass cannot be
starved by urgent passes. Pure rule first, then the real loop (in-memory EC2 whose listing is held
open, the real planner, state DB and registry)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from fleetd.adapters.ec2 import LaunchSpec
from fleetd.config import BudgetConfig, CapacityConfig, FleetConfig, FleetdConfig
from fleetd.intake.events import InterruptionNotice
from fleetd.intake.registry import NodeRegistry
from fleetd.policy.model import Market
from fleetd.policy.planner import plan
from fleetd.reconcile.build import ledger_beside
from fleetd.reconcile.loop import Reconciler
from fleetd.reconcile.pass_schedule import FullPassLimits, UrgentLimits, resume_at, urgent_step, woken_full_pass_at
from fleetd.reconcile.state import StateStore
from tests.reconcile_support import FakeClock
from tests.test_reconcile_urgent import BOOK, A, B, Commander, HeldListing

LIMITS = UrgentLimits(max_share=0.5)


def step(seen, planned, started=None, busy=0.0, now=100.0):
    return urgent_step(
        notices_seen=seen, notices_planned=planned, full_started_at=started, urgent_busy_s=busy, now=now, limits=LIMITS
    )


def test_no_new_notice_no_urgent_pass() -> None:
    assert step(4, 4) == "skip"
    assert step(4, 4, started=99.0) == "skip"


def test_new_notices_between_passes_take_one_urgent_pass() -> None:
    assert step(5, 1) == "urgent"  # four notices since the last plan: one pass for all of them
    assert step(None, None) == "urgent"  # an observer that does not count: every wake-up is news


def test_beside_a_full_pass_urgent_passes_take_at_most_their_share_of_its_time() -> None:
    # A full pass waiting 20 s on EC2 leaves room for many short urgent passes...
    assert step(2, 1, started=80.0, busy=9.9) == "urgent"
    # ...but back-to-back long ones beside it are held until the share is back under the limit.
    assert step(2, 1, started=96.0, busy=2.5) == "defer"
    assert resume_at(96.0, 2.5, LIMITS) == 101.0
    assert step(2, 1, started=96.0, busy=2.5, now=101.0) == "urgent"


@given(st.integers(0, 100), st.integers(0, 100), st.floats(0, 60), st.floats(0, 60), st.booleans())
def test_property_urgent_passes_never_exceed_their_share(seen, planned, busy, age, running) -> None:
    got = step(seen, planned, started=100.0 - age if running else None, busy=busy)
    elapsed = 100.0 - (100.0 - age)  # as the rule sees it: a tiny age rounds away (age 3e-72 -> 0.0)
    if seen == planned:
        assert got == "skip"
    elif running and busy > LIMITS.max_share * elapsed:
        assert got == "defer"
        # Resumed no earlier than the share allows, and then allowed.
        at = resume_at(100.0 - age, busy, LIMITS)
        assert at >= 100.0 - 1e-9 and step(seen, planned, started=100.0 - age, busy=busy, now=at + 1e-6) == "urgent"
    else:
        assert got == "urgent"


def test_a_woken_full_pass_waits_out_its_share_of_the_loop() -> None:
    half = FullPassLimits(max_share=0.5)
    assert woken_full_pass_at(None, None, half) == float("-inf")  # none ran yet: at once
    assert woken_full_pass_at(10.0, 11.0, half) == 12.0  # a 1 s pass: the next 1 s after it
    assert woken_full_pass_at(10.0, 10.01, half) == 10.02  # small fleets: milliseconds
    assert woken_full_pass_at(10.0, 11.0, FullPassLimits(max_share=0.25)) == 14.0


@given(st.floats(0, 1e4), st.floats(0, 100), st.floats(0.05, 1.0))
def test_property_woken_full_passes_never_exceed_their_share(start, took, share) -> None:
    limits = FullPassLimits(max_share=share)
    ended = start + took
    at = woken_full_pass_at(start, ended, limits)
    assert at >= ended
    # From one pass's start to the next one's, the pass itself is at most `share` of the time.
    assert took <= share * (at - start) * (1 + 1e-9) + 1e-9


async def _until(cond, what: str, tries: int = 1000) -> None:
    for _ in range(tries):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not reached: {what}")


async def reconciler_on(ec2, tmp_path: Path, nodes: int, planner):
    """A Reconciler over ``ec2`` holding ``nodes`` seed nodes, with a registry and a commander."""
    await ec2.launch(LaunchSpec("seed", nodes, Market.SPOT, (A,)))
    cfg = FleetdConfig(
        fleet=FleetConfig(name="t", min_nodes=nodes, max_nodes=nodes, state_dir=tmp_path, reconcile_interval_s=600.0),
        capacity=CapacityConfig(instance_types=("g4dn.xlarge", "g5.xlarge"), zones=("us-east-1a",)),
        budget=BudgetConfig(total_usd=1e6, max_usd_per_hour=1e4),
    )
    registry, commander = NodeRegistry(clock=ec2.clock), Commander()
    state = await StateStore.open(tmp_path)
    r = Reconciler(
        cfg,
        ec2=ec2,
        prices=BOOK,
        state=state,
        pools=(A, B),
        hardware={t: BOOK.hardware(t) for t in ("g4dn.xlarge", "g5.xlarge")},
        planner=planner,
        clock=ec2.clock,
        observer=registry,
        commander=commander,
        ledger=await ledger_beside(state),
    )
    return r, registry, commander, state


async def test_loop_folds_notices_into_one_urgent_pass_and_holds_urgent_passes_to_their_share(tmp_path: Path) -> None:
    """A full pass waits on EC2's listing. Notice 0's urgent pass takes 1 s (its planner held);
    notices 1-3 arrive meanwhile. The urgent passes have then had more than half the full pass's
    time: the next one is deferred (logged), then ONE urgent pass drains 1-3 while the full pass
    is still waiting. Afterwards, with the share back under the limit, notice 4 is drained at
    once beside the same full pass."""
    clock = FakeClock(1_800_000_000.0)
    ec2 = HeldListing(clock)
    ec2.release, ec2.listing = asyncio.Event(), asyncio.Event()
    gate = threading.Event()
    gate.set()
    calls: list[int] = []

    def planner(obs, cfg, now):  # the real planner; held at the gate (it runs in a worker thread)
        calls.append(1)
        gate.wait(30)
        return plan(obs, cfg, now)

    r, registry, commander, state = await reconciler_on(ec2, tmp_path, 8, planner)
    r.urgent_limits = UrgentLimits(max_share=0.5)
    wake = asyncio.Event()
    passes: list = []
    ids = sorted(i.instance_id for i in ec2.live())

    def notice(k: int) -> None:
        registry.apply(
            InterruptionNotice(ids[k], "terminate", clock() + 120, "imds", received_at=clock(), dedup_key=f"n{k}")
        )
        wake.set()

    loop = asyncio.create_task(r.run(wake, on_pass=passes.append))
    try:
        with capture_logs() as logs:
            await _until(lambda: passes, "the first pass")
            ec2.hold = True  # the next full pass stays in its observation until released
            wake.set()
            await asyncio.wait_for(ec2.listing.wait(), 10)
            planned = len(calls)
            gate.clear()
            notice(0)  # urgent pass 1, held in its planner
            await _until(lambda: len(calls) == planned + 1, "urgent pass 1 planning")
            for k in (1, 2, 3):  # arrive while urgent pass 1 runs
                notice(k)
            await asyncio.sleep(1.0)
            gate.set()
            await _until(lambda: len(commander.drained) == 4, "notices 0-3 drained")
            assert any(e["event"] == "urgent_pass_deferred" for e in logs)
            assert len(calls) == planned + 2  # 1, then ONE pass for notices 1-3
            assert sorted(commander.drained[1:]) == ids[1:4]
            notice(4)
            await _until(lambda: len(commander.drained) == 5, "notice 4 drained")
            assert not passes[1:]  # all beside the one full pass, still waiting on EC2
            ec2.release.set()
            await _until(lambda: len(passes) >= 2, "the full pass ended")
        assert sorted(commander.drained) == sorted(ids[:5])
    finally:
        gate.set()
        ec2.release.set()
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await state.close()


class SlowListing(HeldListing):
    """A full pass's DescribeInstances takes 0.6 s (urgent passes do not list)."""

    async def list_instances(self):
        await asyncio.sleep(0.6)
        return await super().list_instances()


async def test_wake_ups_without_notices_do_not_run_full_passes_back_to_back(tmp_path: Path) -> None:
    """Statuses wake the loop every 20 ms and each full pass takes 0.6 s: full passes then take
    at most half the loop (back to back: 6 in 3.6 s), and a notice in the middle of it is
    drained by an urgent pass at once, whether a full pass is running or held back."""
    clock = FakeClock(1_800_000_000.0)
    ec2 = SlowListing(clock)
    r, registry, commander, state = await reconciler_on(ec2, tmp_path, 4, plan)
    wake = asyncio.Event()
    passes: list = []
    ids = sorted(i.instance_id for i in ec2.live())
    loop = asyncio.create_task(r.run(wake, on_pass=passes.append))
    try:
        await _until(lambda: passes, "the first pass")
        first = len(passes)
        t0 = time.monotonic()
        drained_after: list[float] = []
        for k in range(3):  # notices 0.9 s, 1.9 s and 2.9 s into the storm: any phase of the loop
            while time.monotonic() - t0 < 0.9 + 1.0 * k:
                wake.set()  # a status: news, not a notice
                await asyncio.sleep(0.02)
            sent = time.monotonic()
            registry.apply(
                InterruptionNotice(ids[k], "terminate", clock() + 120, "imds", received_at=clock(), dedup_key=f"n{k}")
            )
            wake.set()
            while len(commander.drained) <= k:
                await asyncio.sleep(0.005)
            drained_after.append(time.monotonic() - sent)
        while time.monotonic() - t0 < 3.6:
            wake.set()
            await asyncio.sleep(0.02)
        full_passes = len(passes) - first
        assert full_passes <= 4, full_passes  # 0.6 s each, at most half of ~3.6 s (+1 started)
        assert max(drained_after) < 0.4, drained_after  # never behind a full pass (0.6 s) or its hold
        assert commander.drained == ids[:3]
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await state.close()


async def test_a_notice_that_arrived_during_an_urgent_pass_does_not_wait_for_the_next_listing(tmp_path: Path) -> None:
    """Notice 1 arrives while notice 0's urgent pass runs; the full pass after it then waits on
    EC2's listing. Notice 1 is drained at once, not after the listing (old: its wake-up was
    cleared with the others when the full pass began, and it waited 8 s at 2,000 agents)."""
    clock = FakeClock(1_800_000_000.0)
    ec2 = HeldListing(clock)
    ec2.release, ec2.listing = asyncio.Event(), asyncio.Event()
    gate = threading.Event()
    gate.set()
    calls: list[int] = []

    def planner(obs, cfg, now):
        calls.append(1)
        gate.wait(30)
        return plan(obs, cfg, now)

    r, registry, commander, state = await reconciler_on(ec2, tmp_path, 4, planner)
    wake = asyncio.Event()
    passes: list = []
    ids = sorted(i.instance_id for i in ec2.live())

    def notice(k: int) -> None:
        registry.apply(
            InterruptionNotice(ids[k], "terminate", clock() + 120, "imds", received_at=clock(), dedup_key=f"n{k}")
        )
        wake.set()

    loop = asyncio.create_task(r.run(wake, on_pass=passes.append))
    try:
        await _until(lambda: passes, "the first pass")
        planned = len(calls)
        gate.clear()
        notice(0)  # wakes the idle loop: its urgent pass is held in the planner
        await _until(lambda: len(calls) == planned + 1, "urgent pass 0 planning")
        notice(1)  # arrives meanwhile
        ec2.hold = True  # the full pass that follows waits on EC2's listing
        await asyncio.sleep(0.3)  # longer than the first pass took: the full pass is not held back
        gate.set()
        await _until(lambda: len(commander.drained) == 2, "notice 1 drained while the listing is held")
        assert commander.drained == ids[:2]
        assert len(passes) == 1  # the full pass is still waiting on EC2
    finally:
        gate.set()
        ec2.release.set()
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await state.close()
