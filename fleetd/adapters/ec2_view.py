"""EC2's instance list, kept by its own task so that a reconcile pass never waits on it.

DescribeInstances of 2,000 instances takes seconds on AWS (20-40 s on moto), and inside the pass it
stood between a notice and its drain. ``Ec2View`` wraps an :class:`~fleetd.adapters.ec2.Ec2Api`: a
refresher (``run``) lists at most every ``refresh_s``; ``list_instances`` returns the newest listing
at once, fleetd's own launches and terminations laid over it; a listing past ``max_age_s`` is not
served (the last AWS error is raised). (docs/DESIGN.md "How far one control host goes")
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError

from fleetd.adapters.aws_errors import AwsError, TransientAwsError, translate
from fleetd.adapters.ec2 import ALL_STATES, TAG_FLEET, AioEc2, Ec2Api, Ec2Instance, LaunchResult, LaunchSpec
from fleetd.shared.backoff import Backoff
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

_T = TypeVar("_T")


class Ec2View:
    def __init__(
        self,
        inner: Ec2Api,
        *,
        refresh_s: float,
        lister: Callable[[], list[Ec2Instance]] | None = None,
        max_age_s: float,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = inner
        # A blocking DescribeInstances (its own botocore client) run in a worker thread: parsing
        # the XML of 2,000 instances is seconds of CPU, and inside the event loop it held the
        # intake (a notice waited 4.4 s behind a 500-instance listing; bench/agents_load.py).
        self.lister = lister
        self.refresh_s = refresh_s
        self.max_age_s = max_age_s
        self.clock = clock
        self.monotonic = monotonic
        self._listing: dict[str, Ec2Instance] | None = None
        self._listing_started: float = float("-inf")  # monotonic start of the listing's describe
        self._trusted_from: float = float("-inf")  # listings that started before are not served
        self._launched: dict[str, tuple[Ec2Instance, float]] = {}  # id -> (instance, returned at)
        self._terminated: dict[str, tuple[float, float]] = {}  # id -> (returned at, wall time)
        self._error: AwsError | None = None
        self._running = False
        self._inflight: asyncio.Future[None] | None = None
        self._describe_started: float | None = None  # monotonic start of the describe on the wire
        self.describe_seconds: list[float] = []  # recent DescribeInstances durations (bench, status)
        # Seconds callers spent awaiting EC2 through this view (the pass logs its share: what a
        # pass costs fleetd itself vs. what it waits on AWS).
        self.waited_s = 0.0

    def close(self) -> None:
        """Stop the lister's child process, if it has one (blocking, bounded: call it in a thread)."""
        close = getattr(self.lister, "close", None)
        if close is not None:
            close()

    def distrust_before_now(self) -> None:
        """Serve no listing that started before this moment. For a host that just took the
        lease (fleetd/ha/leadership.py): another leader changed EC2 meanwhile, and its launches
        are in no overlay here; a listing taken before would show them missing, and the pass
        would end them as lost and buy them again (seen: a leader frozen mid-listing led again
        23 s later on that listing)."""
        self._trusted_from = self.monotonic()

    # -- Ec2Api -----------------------------------------------------------------------------------
    async def list_instances(self) -> list[Ec2Instance]:
        while self._listing_started < self._trusted_from:
            await self._waited(self.refresh())  # the one in flight may predate the mark: another
        if not self._running or self._listing is None:
            await self._waited(self.refresh())
        elif self.monotonic() - self._listing_started > self._max_age():
            if self._error is not None:
                raise self._error
            # No error, just slow. A describe on the wire that is not overdue itself means the
            # refresher is healthy: waiting for it would hold the pass for the rest of its run
            # (3.2 s at 2,000 instances on moto) to see instances a few seconds fresher, while
            # fleetd's own writes are laid over the listing anyway. Only a stuck one is waited for.
            on_wire = self._describe_started
            if on_wire is None or self.monotonic() - on_wire > self._max_age():
                await self._waited(self.refresh())
        return self._merged()

    async def _waited(self, call: Awaitable[_T]) -> _T:
        started = time.perf_counter()
        try:
            return await call
        finally:
            self.waited_s += time.perf_counter() - started

    def _max_age(self) -> float:
        # A healthy refresher's listing is up to two describes old (one running, one idle gap).
        last = self.describe_seconds[-1] if self.describe_seconds else 0.0
        return max(self.max_age_s, 3 * last)

    async def launch(self, spec: LaunchSpec) -> LaunchResult:
        result = await self._waited(self.inner.launch(spec))
        at = self.monotonic()
        for inst in result.instances:
            self._launched[inst.instance_id] = (inst, at)
        return result

    async def terminate(self, instance_ids: Sequence[str]) -> list[str]:
        done = await self._waited(self.inner.terminate(instance_ids))
        at, wall = self.monotonic(), self.clock()
        for iid in done:
            self._terminated.setdefault(iid, (at, wall))
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # instances_of_launch and the like go straight through

    # -- the refresher ----------------------------------------------------------------------------
    async def refresh(self) -> None:
        """One DescribeInstances at a time: a pass that needs a listing while the refresher's is
        on the wire waits for that one (two whole-fleet describes at start doubled the load on
        the API; at 2,000 instances on a loaded moto both timed out)."""
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.ensure_future(self._refresh())
        # Shielded: a cancelled caller (the pass) leaves the describe to the other one.
        await asyncio.shield(self._inflight)

    async def _refresh(self) -> None:
        started = self._describe_started = self.monotonic()
        try:
            if self.lister is not None:
                instances = await asyncio.to_thread(self.lister)
            else:
                instances = await self.inner.list_instances()
        except AwsError as exc:
            self._error = exc
            raise
        except Exception as exc:  # noqa: BLE001 - a malformed answer (a 500 with a body botocore
            # cannot parse, an instance without its fields) is a failed listing, retried with
            # backoff like any other: it must not end the refresher, or the daemon with it.
            err = TransientAwsError("DescribeInstances", type(exc).__name__, str(exc)[:300])
            self._error = err
            raise err from exc
        finally:
            self._describe_started = None
        took = self.monotonic() - started
        self.describe_seconds = [*self.describe_seconds[-99:], took]
        log.info("ec2_listed", seconds=round(took, 3), instances=len(instances))
        if started < self._listing_started:
            return  # a newer listing came in meanwhile (a pass and the refresher overlapped)
        self._listing = {i.instance_id: i for i in instances}
        self._listing_started = started
        self._error = None
        # Writes that returned before this describe began are in it: forget them. Until then the
        # overlay keeps the planner from seeing fewer nodes than fleetd bought (a double buy) or a
        # node it ended as running.
        self._launched = {k: v for k, v in self._launched.items() if v[1] >= started}
        self._terminated = {k: v for k, v in self._terminated.items() if v[0] >= started}

    async def run(self, ctx: Any = None) -> None:
        """Refresh until cancelled; AWS errors are kept (and raised to the pass once the listing
        is too old) and retried with backoff."""
        self._running = True
        delay = self.refresh_s
        backoff = Backoff(2 * self.refresh_s, 300.0)
        try:
            while True:
                started = self.monotonic()
                try:
                    await self.refresh()
                    delay = self.refresh_s
                    backoff.reset()
                except AwsError as exc:
                    log.warning("ec2_view_refresh_failed", code=exc.code, kind=exc.kind, error=exc.message)
                    delay = backoff.next_delay()
                took = self.monotonic() - started
                # At most every refresh_s, and idle at least as long as the last describe took:
                # a listing that takes 20 s (2,000 instances on moto) is not re-asked back to back
                # (DescribeInstances shares the account's API rate budget with CreateFleet).
                await asyncio.sleep(max(delay - took, took if delay == self.refresh_s else 0.0))
        finally:
            self._running = False

    def _merged(self) -> list[Ec2Instance]:
        out = dict(self._listing or {})
        for iid, (inst, _) in self._launched.items():
            out.setdefault(iid, inst)
        for iid, (_, wall) in self._terminated.items():
            listed = out.get(iid)
            if listed is not None and listed.live:  # as DescribeInstances shows right after TerminateInstances
                out[iid] = dataclasses.replace(
                    listed,
                    state="shutting-down",
                    ended_at=wall,
                    state_reason=listed.state_reason or "Client.UserInitiatedShutdown",
                )
        return list(out.values())


def blocking_lister(adapter: AioEc2, client: Any) -> Callable[[], list[Ec2Instance]]:
    """``adapter.list_instances`` over a *synchronous* botocore client, to run in a worker thread:
    same filters, same conversion, same error translation."""
    params = {
        "Filters": [
            {"Name": f"tag:{TAG_FLEET}", "Values": [adapter.fleet]},
            {"Name": "instance-state-name", "Values": list(ALL_STATES)},
        ]
    }

    def run() -> list[Ec2Instance]:
        out: list[Ec2Instance] = []
        try:
            for page in client.get_paginator("describe_instances").paginate(**params):
                for reservation in page.get("Reservations", []):
                    out.extend(adapter._instance(item) for item in reservation.get("Instances", []))
        except (ClientError, BotoCoreError) as exc:
            raise translate(exc, "DescribeInstances") from exc
        return out

    return run
