"""The agent's event outbox: held until acknowledged, journaled so an agent restart loses nothing."""

from __future__ import annotations

import asyncio

from agent.node.outbox import Outbox, OutboxItem


def item(n: int) -> OutboxItem:
    return OutboxItem(f"id{n}", "fleetd/f/nodes/i-1/events", f'{{"n": {n}}}'.encode())


async def test_restart_recovers_unacknowledged_events_in_order(tmp_path) -> None:
    journal = tmp_path / "outbox.jsonl"
    box = Outbox(journal)
    assert await box.open() == 0
    for n in range(5):
        await box.put(item(n))
    await box.put(item(1))  # the same msg_id again is one event
    await box.ack("id0")
    await box.ack("id3")
    with journal.open("a") as f:
        f.write('{"op": "put", "id": "torn')  # a crash mid-write

    again = Outbox(journal)
    assert await again.open() == 3
    assert (await again.first()).msg_id == "id1"
    for expected in ("id1", "id2", "id4"):
        first = await again.first()
        assert first.msg_id == expected and first.payload == item(int(expected[2:])).payload
        await again.ack(expected)
    assert len(again) == 0 and journal.read_text() == ""


async def test_first_waits_and_overflow_drops_oldest() -> None:
    box = Outbox(None, max_items=3)
    waiter = asyncio.create_task(box.first())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    for n in range(5):
        await box.put(item(n))
    assert (await waiter).msg_id == "id2"  # the oldest that survived the overflow
    assert (await box.first()).msg_id == "id2" and box.dropped == 2
    for n in (2, 3, 4):
        await box.ack(f"id{n}")
    await asyncio.wait_for(box.wait_empty(), 1)


async def test_unwritable_journal_costs_only_the_restart_guarantee(tmp_path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    box = Outbox(blocker / "outbox.jsonl")  # its parent is a file: every write fails
    await box.open()
    await box.put(item(1))
    assert (await box.first()).msg_id == "id1"
    await box.ack("id1")
    assert len(box) == 0
