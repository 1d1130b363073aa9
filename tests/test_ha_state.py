"""The HA state backend (DynamoDB on moto server): the drain journal on both backends, the
ledger in DynamoDB, and the fence: a host that lost the lease cannot write anything."""

from __future__ import annotations

import pytest

from fleetd.ha.errors import LeaseLost
from fleetd.ha.table import MAX_PUTS
from fleetd.policy.lease import LeaseRecord
from fleetd.policy.model import Market
from fleetd.reconcile import journal
from fleetd.reconcile.state_dynamo import DynamoLedger, DynamoStateStore
from tests.ha_support import Opener, PinnedFence, dynamo_table
from tests.test_ledger import FIRST_HALF, GOODPUT, SECOND_HALF
from tests.test_ledger import T0 as LEDGER_T0
from tests.test_reconcile_state import T0, A, seen


async def test_the_drain_journal_survives_a_reopen(open_state: Opener) -> None:
    store = await open_state()
    await store.sync_instances([seen("i-1"), seen("i-2"), seen("i-3")], T0)
    first = await journal.record_drain(store, "i-1", T0, T0 + 120, "notice")
    again = await journal.record_drain(store, "i-1", T0 + 5, T0 + 300, "other")  # kept as it was
    assert first == again and (first.deadline, first.reason, first.sent_at) == (T0 + 120, "notice", None)
    await journal.record_drain(store, "i-2", T0, None, "scale-in")
    await journal.mark_drain_sent(store, "i-2", T0 + 1)
    await store.mark_terminate_requested(["i-3"], T0)
    await store.close()
    store = await open_state()
    assert [d.instance_id for d in await journal.unsent_drains(store)] == ["i-1"]
    assert await journal.unfinished_terminations(store, T0 + 31) == ["i-3"]
    assert await journal.unfinished_terminations(store, T0) == []
    await store.close()


async def test_the_ledger_in_dynamodb_is_stored_once_per_event_and_survives_a_new_leader(
    aio_session, aws_client_kwargs
) -> None:
    async with aio_session.create_client("dynamodb", **aws_client_kwargs) as client:
        table = await dynamo_table(client)
        fence = PinnedFence()
        ledger = DynamoLedger(table, fence)
        assert await ledger.append(*FIRST_HALF) == len(FIRST_HALF)
        assert round(await ledger.spent_usd(LEDGER_T0 + 1000), 2) == 0.12
        successor = DynamoLedger(table, fence)  # a new leader reads it all
        assert round(await successor.spent_usd(LEDGER_T0 + 1000), 2) == 0.12
        assert await successor.append(FIRST_HALF[0], *SECOND_HALF) == len(SECOND_HALF)
        await successor.append(*GOODPUT)
        summary = await DynamoLedger(table, fence).summary(LEDGER_T0 + 10_000)
        assert summary.spend_usd == pytest.approx(0.80, abs=1e-9)
        assert summary.useful_steps == 1600 and summary.steps_lost == 20


async def test_a_host_whose_lease_was_taken_cannot_write(aio_session, aws_client_kwargs) -> None:
    """The old leader's copy still says it leads (it was paused); the store refuses its write,
    nothing of it lands, and it gives the lease up."""
    async with aio_session.create_client("dynamodb", **aws_client_kwargs) as client:
        table = await dynamo_table(client, holder="host-a")
        old = DynamoStateStore(table, PinnedFence("host-a", 1))
        await old.sync_instances([seen("i-1")], T0)
        # host-b takes over (the lease had expired by its clock) and writes generation 2.
        assert await table.put_lease(LeaseRecord("host-b", 2, "v2"), LeaseRecord("host-a", 1, "v1"))
        new = DynamoStateStore(table, PinnedFence("host-b", 2))
        with pytest.raises(LeaseLost):
            await old.record_intent(
                token="tok-old",
                seq=0,
                now=T0,
                count=5,
                market=Market.SPOT,
                pools=(A,),
                purpose="capacity",
                max_price_per_hour=0.5,
                reason="paused leader",
            )
        assert old.fence.leading is False
        with pytest.raises(LeaseLost):  # and it stays refused before sending anything
            await old.record_notice("i-1", T0 + 1)
        assert await new.launches() == []
        assert [r.notice_at for r in await new.instances()] == [None]
        assert await new.record_notice("i-1", T0 + 2) is True


async def test_a_write_larger_than_one_transaction_is_split_and_every_part_fenced(
    aio_session, aws_client_kwargs
) -> None:
    async with aio_session.create_client("dynamodb", **aws_client_kwargs) as client:
        table = await dynamo_table(client)
        store = DynamoStateStore(table, PinnedFence())
        many = [seen(f"i-{n:04d}") for n in range(2 * MAX_PUTS + 7)]
        report = await store.sync_instances(many, T0)
        assert len(report.adopted) == len(many)
        fresh = DynamoStateStore(table, PinnedFence())
        assert len(await fresh.instances()) == len(many)


async def test_fleetd_report_reads_the_shared_ledger(aio_session, aws_client_kwargs, tmp_path) -> None:
    """`fleetd report` on any control host of an HA fleet reads the table, not a local file."""
    import json
    import os
    import subprocess
    import sys

    async with aio_session.create_client("dynamodb", **aws_client_kwargs) as client:
        table = await dynamo_table(client, fleet="rep")
        table.name = "fleetd-state"
        await DynamoLedger(table, PinnedFence()).append(*FIRST_HALF, *SECOND_HALF)
    config = tmp_path / "fleetd.toml"
    config.write_text(f"""
[fleet]
name = "rep"
state_dir = "{tmp_path / "nothing-here"}"
[ha]
backend = "dynamodb"
table = "fleetd-state"
endpoint_url = "{aws_client_kwargs["endpoint_url"]}"
""")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fleetd.cli",
            "report",
            "--json",
            "--config",
            str(config),
            "--at",
            str(LEDGER_T0 + 10_000),
        ],
        capture_output=True,
        text=True,
        env=os.environ,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["spend_usd"] == pytest.approx(0.80, abs=1e-6)


async def test_a_dry_runs_private_copy_reads_the_shared_state_and_writes_nothing(
    aio_session, aws_client_kwargs
) -> None:
    async with aio_session.create_client("dynamodb", **aws_client_kwargs) as client:
        table = await dynamo_table(client)
        await DynamoStateStore(table, PinnedFence()).sync_instances([seen("i-1")], T0)
        dry = DynamoStateStore(table, PinnedFence("someone-else", 99), persist=False)  # holds no lease
        assert [r.instance_id for r in await dry.instances()] == ["i-1"]
        await dry.record_notice("i-1", T0 + 1)
        await dry.sync_instances([seen("i-1"), seen("i-2")], T0 + 2)
        assert [r.notice_at for r in await dry.instances()] == [T0 + 1, None]
        shared = DynamoStateStore(table, PinnedFence())
        assert [(r.instance_id, r.notice_at) for r in await shared.instances()] == [("i-1", None)]
