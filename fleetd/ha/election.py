"""The lease adapter: reads and writes the lease item (fleetd.ha.table) on the pure decisions of
fleetd.policy.lease, and is the :class:`fleetd.ha.table.Fence` every leader write goes through.

One step per ``renew_every_s``: read the record (strongly consistent), fold it in, write if the
decision says so. The monotonic clock is the only clock used (a host's wall clock may jump).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

from fleetd.adapters.aws_errors import AwsError
from fleetd.ha.errors import LeaseLost
from fleetd.ha.table import DynamoTable
from fleetd.policy import lease
from fleetd.shared.logs import get_logger
from fleetd.shared.waits import wait_set

log = get_logger(__name__)


class Election:
    def __init__(
        self, table: DynamoTable, holder: str, timing: lease.LeaseTiming, clock: Callable[[], float] = time.monotonic
    ):
        self.table, self.holder, self.timing, self.clock = table, holder, timing, clock
        self.state = lease.LeaseState()
        self._changed = asyncio.Event()  # set on every change of leadership
        self.on_standby: Callable[[], Awaitable[None]] | None = None  # called each step while standing by

    # -- Fence ------------------------------------------------------------------------------------
    def generation(self) -> int:
        now = self.clock()
        if not self.state.leads(now):
            if self.state.held is not None:
                self._lose("lease expired before a renewal succeeded")
            raise LeaseLost("this host does not hold the lease")
        assert self.state.held is not None
        return self.state.held

    def refused(self, what: str) -> None:
        self._lose(what)
        raise LeaseLost(what)

    def leads(self) -> bool:
        return self.state.leads(self.clock())

    # -- waiting on leadership --------------------------------------------------------------------
    async def wait_leading(self) -> int:
        while True:
            if self.leads():
                assert self.state.held is not None
                return self.state.held
            self._changed.clear()
            if self.leads():
                continue
            await self._changed.wait()

    async def wait_lost(self, generation: int) -> None:
        """Returns nothing: raises LeaseLost once this host no longer leads at ``generation``
        (checked at every change and at least every renewal period, by the local clock)."""
        while True:
            if self.state.held == generation and not self.leads():
                self._lose("lease expired before a renewal succeeded")
            if not self.leads() or self.state.held != generation:
                raise LeaseLost("lease lost")
            self._changed.clear()
            await wait_set(self._changed, self.timing.renew_every_s / 2)

    # -- the loop ---------------------------------------------------------------------------------
    async def step(self) -> None:
        was = self.state.held
        record = await self.table.get_lease()
        self.state, why = lease.observe(self.holder, self.state, record, self.clock())
        if why is not None:
            self._lost_log(was, why)
        decision = lease.decide(self.holder, self.state, self.clock(), self.timing, uuid.uuid4().hex)
        if decision.write is None:
            return
        started = self.clock()
        ok = await self.table.put_lease(decision.write, decision.expect)
        held_before = self.state.held
        self.state, why = lease.after_write(self.state, decision, ok, started, self.timing)
        if why is not None:
            self._lost_log(held_before, why)
        if ok and decision.step is lease.Step.ACQUIRE:
            log.warning("lease_acquired", holder=self.holder, generation=decision.write.generation, why=decision.reason)
            self._changed.set()

    async def run(self, stopping: asyncio.Event) -> None:
        """Step until ``stopping``; a store error is logged and retried at the next step (the
        local lease keeps counting down meanwhile: a leader cut off from the store stops acting)."""
        refreshed_at: float | None = None
        while not stopping.is_set():
            try:
                await self.step()
            except AwsError as exc:
                log.warning("lease_step_failed", kind=exc.kind, code=exc.code, error=exc.message)
            if not self.leads() and self.state.held is not None:
                self._lose("lease expired before a renewal succeeded")
            now = self.clock()
            standby = not self.leads()
            if (
                standby
                and self.on_standby is not None
                and (refreshed_at is None or now - refreshed_at >= self.timing.renew_every_s)
            ):
                refreshed_at = now  # the whole state is read once per renewal period, not per poll
                try:
                    await self.on_standby()
                except AwsError as exc:
                    log.warning("standby_refresh_failed", kind=exc.kind, code=exc.code, error=exc.message)
            await wait_set(stopping, self.timing.poll_s if standby else self.timing.renew_every_s)

    async def release(self) -> None:
        """A clean stop hands the lease over at once instead of after ``lease_s``: the record is
        rewritten with no holder's name and the generation kept, so a standby's next write wins."""
        if not self.leads() or self.state.seen is None:
            return
        gen = self.state.held
        assert gen is not None
        try:
            await self.table.put_lease(lease.LeaseRecord("", gen, uuid.uuid4().hex), self.state.seen)
        except AwsError as exc:
            log.warning("lease_release_failed", error=str(exc))
        self.state = lease.LeaseState()
        self._changed.set()
        log.info("lease_released", holder=self.holder, generation=gen)

    def _lose(self, why: str) -> None:
        held = self.state.held
        self.state = lease.LeaseState(seen=self.state.seen, seen_since=self.state.seen_since)
        self._lost_log(held, why)

    def _lost_log(self, held: int | None, why: str) -> None:
        if held is None:
            return
        log.warning(
            "lease_lost",
            holder=self.holder,
            generation=held,
            why=why,
            then="standing by: no launch, termination or state write from this host",
        )
        self._changed.set()
