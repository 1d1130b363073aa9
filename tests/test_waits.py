"""Waits with a time limit never lose a cancellation (fleetd/shared/waits.py).

CI hung 600 s in a reconcile-loop test: the test cancelled the loop in the same loop iteration
as a finished cloud call set the loop's wake-up event, Python 3.11's ``asyncio.wait_for`` returned
the event's result instead of raising (CPython gh-86296), and the loop ran on. The helpers, and the
real reconcile loop built on them, are checked here against exactly that interleaving.
"""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest

from fleetd.policy.planner import plan
from fleetd.shared.waits import wait_set, within
from tests.import_graph import ROOT
from tests.reconcile_support import FakeClock
from tests.test_pass_schedule import reconciler_on
from tests.test_reconcile_urgent import FakeEc2


async def _cancel_as_the_event_is_set(waiter, event: asyncio.Event) -> asyncio.Task:
    task = asyncio.create_task(waiter)
    await asyncio.sleep(0)  # the task now waits on the event
    event.set()  # wakes the event's waiter ...
    task.cancel()  # ... in the same loop iteration as the cancellation
    await asyncio.gather(task, return_exceptions=True)
    return task


async def test_wait_set_answers_set_and_timeout() -> None:
    event = asyncio.Event()
    assert await wait_set(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_set(event, 5) is True
    assert await wait_set(event, 0) is True  # already set: no wait at all


async def test_within_returns_the_result_or_times_out_and_cancels_the_coroutine() -> None:
    assert await within(asyncio.sleep(0, result=7), 1) == 7
    cancelled = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError):
        await within(slow(), 0.01)
    assert cancelled.is_set()


async def test_a_cancellation_as_the_event_is_set_is_not_lost() -> None:
    event = asyncio.Event()

    async def waits() -> str:
        await wait_set(event, 10)
        return "went on after a cancel"

    task = await _cancel_as_the_event_is_set(waits(), event)
    assert task.cancelled()


async def test_the_interleaving_is_the_one_that_loses_it_in_asyncio_wait_for() -> None:
    # The guard: on 3.11 (CI's Python) this interleaving is the one wait_for loses; if that stopped
    # holding, the tests above would no longer exercise the race. 3.12 rebuilt wait_for on
    # asyncio.timeout, which keeps the cancel.
    event = asyncio.Event()

    async def waits() -> str:
        await asyncio.wait_for(event.wait(), 10)
        return "went on after a cancel"

    task = await _cancel_as_the_event_is_set(waits(), event)
    if sys.version_info < (3, 12):
        assert not task.cancelled() and task.result() == "went on after a cancel"
    else:
        assert task.cancelled()


async def test_the_reconcile_loop_stops_when_cancelled_as_it_is_woken(tmp_path: Path) -> None:
    """The real loop (planner, state DB, registry) idles between passes; it is woken and cancelled
    in one loop iteration (a finished cloud call's wake-up beside the daemon's shutdown). Before
    the fix it ran another pass and waited on: the daemon's stop hung."""
    r, _, _, state = await reconciler_on(FakeEc2(FakeClock(1_800_000_000.0)), tmp_path, 2, plan)
    wake = asyncio.Event()
    passes: list = []
    loop = asyncio.create_task(r.run(wake, on_pass=passes.append))
    try:
        for _ in range(1000):
            if passes:
                break
            await asyncio.sleep(0.01)
        assert passes, "no first pass"
        await asyncio.sleep(0.05)  # idle between passes (600 s interval)
        wake.set()
        loop.cancel()
        done, _ = await asyncio.wait({loop}, timeout=10)
        assert done and loop.cancelled(), f"the loop ran on after its cancel: {len(passes)} passes"
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await state.close()


def test_fleetd_and_the_agent_do_not_use_asyncio_wait_for() -> None:
    uses = [
        f"{p.relative_to(ROOT)}:{n}"
        for pkg in ("fleetd", "agent")
        for p in sorted((ROOT / pkg).rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bwait_for\(", line) and not line.lstrip().startswith("#") and p.name != "waits.py"
    ]
    assert not uses, "use fleetd.shared.waits (wait_for loses cancellations on 3.11):\n" + "\n".join(uses)
