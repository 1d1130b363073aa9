"""Which pass next when the loop is woken (fleetd/reconcile/pass_schedule.py): notices that arrive
while an urgent pass runs fold into ONE following urgent pass, and a running full pass cannot be
starved by urgent passes. Pure rule first, then the real loop (in-memory EC2 whose listing is held
open, the real planner, state DB and registry)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from hypothesis import given, strategies as st
from structlog.testing import capture_logs

from fleetd.adapters.ec2 import LaunchSpec
from fleetd.config import BudgetConfig, CapacityConfig, FleetConfig, FleetdConfig
from fleetd.intake.events import InterruptionNotice
from fleetd.intake.registry import NodeRegistry
from fleetd.policy.model import Market
from fleetd.policy.planner import plan
from fleetd.reconcile.loop import Reconciler
from fleetd.reconcile.pass_schedule import UrgentLimits, urgent_step
from fleetd.reconcile.state import StateStore
from tests.import_graph import ROOT, imported_names
from tests.reconcile_support import FakeClock
from tests.test_import_contract import IO_MODULES
from tests.test_reconcile_urgent import BOOK, A, B, Commander, HeldListing

LIMITS = UrgentLimits(max_beside_full=3, max_full_age_s=5.0)


def step(seen, planned, started=None, beside=0, now=100.0):
    return urgent_step(notices_seen=seen, notices_planned=planned, full_started_at=started,
                       urgent_beside_full=beside, now=now, limits=LIMITS)


def test_the_rule_is_pure() -> None:
    names = imported_names(ROOT / "fleetd" / "reconcile" / "pass_schedule.py")
    assert not {n for n in names if n.split(".")[0] in IO_MODULES}


def test_no_new_notice_no_urgent_pass() -> None:
    assert step(4, 4) == "skip"
    assert step(4, 4, started=99.0) == "skip"


def test_new_notices_between_passes_take_one_urgent_pass() -> None:
    assert step(5, 1) == "urgent"  # four notices since the last plan: one pass for all of them
    assert step(None, None) == "urgent"  # an observer that does not count: every wake-up is news


def test_beside_a_full_pass_urgent_passes_are_bounded_in_number_and_time() -> None:
    assert step(2, 1, started=99.0, beside=0) == "urgent"
    assert step(2, 1, started=99.0, beside=2) == "urgent"
    assert step(2, 1, started=99.0, beside=3) == "defer"
    assert step(2, 1, started=95.0, beside=0, now=100.0) == "defer"  # running 5 s: it finishes first
    assert step(2, 1, started=95.1, beside=0, now=100.0) == "urgent"


@given(st.integers(0, 100), st.integers(0, 100), st.integers(0, 10), st.floats(0, 60), st.booleans())
def test_property_never_more_than_the_limits_beside_a_full_pass(seen, planned, beside, age, running) -> None:
    got = step(seen, planned, started=100.0 - age if running else None, beside=beside)
    if seen == planned:
        assert got == "skip"
    elif running and (beside >= LIMITS.max_beside_full or age >= LIMITS.max_full_age_s):
        assert got == "defer"
    else:
        assert got == "urgent"


async def _until(cond, what: str, tries: int = 1000) -> None:
    for _ in range(tries):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not reached: {what}")


async def test_loop_folds_notices_into_one_urgent_pass_and_defers_past_the_limit(tmp_path: Path) -> None:
    clock = FakeClock(1_800_000_000.0)
    ec2 = HeldListing(clock)
    ec2.release, ec2.listing = asyncio.Event(), asyncio.Event()
    await ec2.launch(LaunchSpec("seed", 8, Market.SPOT, (A,)))
    cfg = FleetdConfig(
        fleet=FleetConfig(name="t", min_nodes=8, max_nodes=8, state_dir=tmp_path, reconcile_interval_s=600.0),
        capacity=CapacityConfig(instance_types=("g4dn.xlarge", "g5.xlarge"), zones=("us-east-1a",)),
        budget=BudgetConfig(total_usd=1e6, max_usd_per_hour=1e4),
    )
    gate = threading.Event()
    gate.set()
    calls: list[int] = []

    def planner(obs, cfg, now):  # the real planner; held at the gate (it runs in a worker thread)
        calls.append(1)
        gate.wait(30)
        return plan(obs, cfg, now)

    registry, commander = NodeRegistry(clock=clock), Commander()
    state = await StateStore.open(tmp_path)
    r = Reconciler(cfg, ec2=ec2, prices=BOOK, state=state, pools=(A, B),
                   hardware={t: BOOK.hardware(t) for t in ("g4dn.xlarge", "g5.xlarge")}, planner=planner,
                   clock=clock, observer=registry, commander=commander)
    r.urgent_limits = UrgentLimits(max_beside_full=3, max_full_age_s=3600.0)
    wake = asyncio.Event()
    passes: list = []
    ids = sorted(i.instance_id for i in ec2.live())

    def notice(k: int) -> None:
        registry.apply(InterruptionNotice(ids[k], "terminate", clock() + 120, "imds", received_at=clock(),
                                          dedup_key=f"n{k}"))
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
            gate.set()
            await _until(lambda: len(commander.drained) == 4, "notices 0-3 drained")
            assert len(calls) == planned + 2  # 1, then ONE pass for notices 1-3
            assert sorted(commander.drained[1:]) == ids[1:4]
            notice(4)  # urgent pass 3: the last one beside this full pass
            await _until(lambda: len(commander.drained) == 5, "notice 4 drained")
            notice(5)  # deferred: the full pass (still observing) ends first
            await _until(lambda: any(e["event"] == "urgent_pass_deferred" for e in logs), "deferred")
            await asyncio.sleep(0.2)
            assert len(calls) == planned + 3 and ids[5] not in commander.drained
            assert not passes[1:]  # the full pass is still running
            ec2.release.set()
            await _until(lambda: ids[5] in commander.drained, "notice 5 drained after the full pass")
            await _until(lambda: len(passes) >= 2, "the full pass ended")
        assert commander.drained.count(ids[5]) == 1
    finally:
        gate.set()
        ec2.release.set()
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await state.close()
