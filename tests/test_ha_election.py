"""The lease adapter (fleetd/ha/election.py) on a DynamoDB table (moto server), with clocks the
test moves: who leads, a takeover after a silent lease, a release, and what a stale host sees."""

from __future__ import annotations

import asyncio

import pytest

from fleetd.ha.election import Election
from fleetd.ha.errors import LeaseLost
from fleetd.ha.table import DynamoTable
from fleetd.policy.lease import LeaseTiming
from fleetd.reconcile.state_dynamo import DynamoStateStore
from tests.reconcile_support import FakeClock
from tests.test_reconcile_state import T0, seen

TIMING = LeaseTiming.for_lease(6.0)


async def test_one_leads_the_other_takes_over_after_a_silent_lease_and_the_old_one_is_fenced(
    aio_session, aws_client_kwargs
) -> None:
    async with aio_session.create_client("dynamodb", **aws_client_kwargs) as client:
        table = DynamoTable(client, "fleetd-state", "f-election")
        await table.ensure()
        ca, cb = FakeClock(0.0), FakeClock(1000.0)  # the hosts' monotonic clocks do not agree
        a, b = Election(table, "a", TIMING, ca), Election(table, "b", TIMING, cb)
        await a.step()
        await b.step()
        assert a.leads() and not b.leads() and a.generation() == 1
        with pytest.raises(LeaseLost):
            b.generation()
        for _ in range(5):  # a renews every 2 s: b never sees 6 s of silence
            ca.advance(2.0)
            cb.advance(2.0)
            await a.step()
            await b.step()
        assert a.leads() and not b.leads()
        # a freezes (no steps); b's clock runs on.
        cb.advance(3.0)
        await b.step()
        assert not b.leads()
        cb.advance(3.0)
        await b.step()
        assert b.leads() and b.generation() == 2
        # a wakes up: its own clock says its lease ran out, and a write with its old view is refused.
        ca.advance(6.0)
        assert not a.leads()
        with pytest.raises(LeaseLost):
            a.generation()
        stale = DynamoStateStore(table, _Believer("a", 1))
        with pytest.raises(LeaseLost):
            await stale.sync_instances([seen("i-1")], T0)
        assert await DynamoStateStore(table, b).instances() == []
        # b stops cleanly: the lease is handed over at a's next step, no lease_s wait.
        await b.release()
        await a.step()
        assert a.leads() and a.generation() == 3


async def test_wait_lost_raises_when_the_local_lease_runs_out(aio_session, aws_client_kwargs) -> None:
    async with aio_session.create_client("dynamodb", **aws_client_kwargs) as client:
        table = DynamoTable(client, "fleetd-state", "f-wait")
        await table.ensure()
        clock = FakeClock(0.0)
        a = Election(table, "a", LeaseTiming(lease_s=0.4, renew_every_s=0.1, guard_s=0.1, poll_s=0.05), clock)
        await a.step()
        gen = await a.wait_leading()
        watch = asyncio.create_task(a.wait_lost(gen))
        await asyncio.sleep(0.01)
        assert not watch.done()
        clock.advance(0.35)  # past lease - guard with no renewal
        with pytest.raises(LeaseLost):
            await asyncio.wait_for(watch, 5)
        assert not a.leads()


class _Believer:
    """A fence that still believes it holds ``gen`` (a process that has not looked at its clock)."""

    def __init__(self, holder: str, gen: int):
        self.holder, self.gen = holder, gen

    def generation(self) -> int:
        return self.gen

    def refused(self, what: str) -> None:
        raise LeaseLost(what)
