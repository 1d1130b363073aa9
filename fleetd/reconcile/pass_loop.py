"""The loop around the reconcile passes: when the next full pass runs, the backoff after a failed
one, and the urgent passes (drains only) that a notice starts beside or between full passes
(within their shares of the loop: pass_schedule.py). ``Reconciler`` (loop.py) supplies the passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from fleetd.adapters.aws_errors import AwsError, Throttled
from fleetd.config import FleetdConfig
from fleetd.policy.model import Plan
from fleetd.policy.observation import Observation
from fleetd.reconcile.cloud_calls import CloudCalls
from fleetd.reconcile.execute import ActionExecutor
from fleetd.reconcile.observe import ObservationBuilder
from fleetd.reconcile.outcome import Outcome
from fleetd.reconcile.pass_schedule import FullPassLimits, UrgentLimits, resume_at, urgent_step, woken_full_pass_at
from fleetd.reconcile.ports import NodeObserver
from fleetd.shared.logs import get_logger
from fleetd.shared.waits import wait_set

log = get_logger(__name__)

MAX_BACKOFF_S = 300.0


@dataclass(frozen=True, slots=True)
class PassReport:
    now: float
    plan: Plan | None = None
    outcomes: tuple[Outcome, ...] = ()
    live_instances: tuple[str, ...] = ()
    error: AwsError | None = None  # the failure that ended the pass early, if any
    observation: Observation | None = None  # what the planner was shown (None: observe failed)

    @property
    def throttled(self) -> bool:
        return isinstance(self.error, Throttled)


class PassLoop:
    """Schedules the passes of the class it is mixed into (``Reconciler``), which sets these:"""

    cfg: FleetdConfig
    observer: NodeObserver
    urgent_limits: UrgentLimits
    full_limits: FullPassLimits
    _consecutive_failures: int
    _notices_planned: int | None
    _executor: ActionExecutor
    _observation: ObservationBuilder

    async def run_pass(self) -> PassReport:
        raise NotImplementedError

    async def run_urgent_pass(self) -> tuple[Outcome, ...]:
        raise NotImplementedError

    def next_delay(self, report: PassReport) -> float:
        interval = self.cfg.fleet.reconcile_interval_s
        if report.error is None:
            soon = report.plan.replan_in_s if report.plan is not None else None
            return interval if soon is None else max(0.05, min(interval, soon))
        # Exponential backoff with jitter, so many controllers do not retry in lockstep.
        backoff = min(interval * (2 ** min(self._consecutive_failures, 10)), MAX_BACKOFF_S)
        delay: float = backoff * random.uniform(0.5, 1.0)
        return delay

    async def run(
        self,
        wake: asyncio.Event,
        passes: int | None = None,
        on_pass: Callable[[PassReport], None] | None = None,
    ) -> None:
        """Run passes until cancelled (or ``passes`` done); ``wake`` starts the next one early;
        ``on_pass`` sees every report (the daemon's watchdog heartbeat). Launches and
        terminations run in the cloud-call task beside the passes; a bounded run ends once its
        calls are made."""
        calls = CloudCalls(on_done=wake.set)
        async with asyncio.TaskGroup() as tg:
            worker = tg.create_task(calls.run(), name="cloud-calls")
            self._executor.calls = calls
            self._observation.in_flight = calls.launch_tokens
            try:
                await self._passes(wake, passes, on_pass)
                await calls.idle()
            finally:
                self._executor.calls = None
                self._observation.in_flight = set
                worker.cancel()

    async def _passes(
        self, wake: asyncio.Event, passes: int | None, on_pass: Callable[[PassReport], None] | None
    ) -> None:
        done = 0
        while passes is None or done < passes:
            # Cleared before the pass: a wake-up that arrives during it starts the next one at once.
            wake.clear()
            started = time.monotonic()
            report = await self._pass_with_urgent(wake)
            ended = time.monotonic()
            done += 1
            if on_pass is not None:
                on_pass(report)
            if passes is not None and done >= passes:
                break
            delay = self.next_delay(report)
            if not await wait_set(wake, delay):
                continue
            # Woken between passes: a new notice's drain goes out from the last observation
            # first (no EC2 read, no state sync: what a full pass costs at 2,000 nodes), and
            # the full pass follows (within its share of the loop: pass_schedule.py; notices
            # meanwhile get urgent passes). Anything else that woke the loop skips the urgent pass.
            await self._urgent()
            await self._hold_full_pass(wake, woken_full_pass_at(started, ended, self.full_limits))

    async def _hold_full_pass(self, wake: asyncio.Event, until: float) -> None:
        while (left := until - time.monotonic()) > 0:
            if not await wait_set(wake, left):
                return
            wake.clear()
            await self._urgent()

    async def _urgent(self) -> None:
        try:
            await self.run_urgent_pass()
        except Exception as exc:  # the full pass after it retries, level-based
            log.warning("urgent_pass_failed", error=repr(exc))

    async def _pass_with_urgent(self, wake: asyncio.Event) -> PassReport:
        """One full pass; a wake-up while it runs starts an urgent pass beside it (drains only),
        within ``urgent_limits`` (pass_schedule.py), and leaves ``wake`` set so the next full
        pass follows at once (after one urgent pass for what arrived meanwhile)."""
        seen = getattr(self.observer, "notices_seen", None)
        if seen is not None and seen != self._notices_planned:
            # Notices counted but not planned yet (they woke the loop while an urgent pass ran,
            # and the wake-up was cleared with the others): drained first, not after this pass's
            # observation, which can wait seconds on EC2's listing (8 s at 2,000 agents).
            await self._urgent()
        task = asyncio.create_task(self.run_pass(), name="reconcile-pass")
        started = time.monotonic()
        busy = 0.0  # what the urgent passes beside it took
        woken = deferred = False
        waiter: asyncio.Task[bool] | None = None
        try:
            while True:
                if not deferred:
                    waiter = asyncio.create_task(wake.wait())
                    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    if task.done():
                        waiter.cancel()
                        return task.result()
                    wake.clear()
                    woken = True
                now = time.monotonic()
                step = urgent_step(
                    notices_seen=getattr(self.observer, "notices_seen", None),
                    notices_planned=self._notices_planned,
                    full_started_at=started,
                    urgent_busy_s=busy,
                    now=now,
                    limits=self.urgent_limits,
                )
                deferred = step == "defer"
                if deferred:
                    # The full pass gets the loop until the urgent share is back under the limit.
                    log.info(
                        "urgent_pass_deferred",
                        urgent_busy_s=round(busy, 3),
                        full_pass_running_s=round(now - started, 3),
                    )
                    await asyncio.wait({task}, timeout=max(0.01, resume_at(started, busy, self.urgent_limits) - now))
                    if task.done():
                        return task.result()
                elif step == "urgent":
                    await self._urgent()
                    busy += time.monotonic() - now
        finally:
            if waiter is not None:
                waiter.cancel()  # a cancel while both were awaited leaves it waiting on `wake`
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if woken:
                wake.set()
