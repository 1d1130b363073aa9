"""The intake's inbox (fleetd/intake/coalesce.py): telemetry coalesces to the latest sample per
node, events are never coalesced, superseded or reordered (and go ahead of waiting samples), and memory is bounded by one pending
sample per node plus the events."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from fleetd.intake.coalesce import CoalescingQueue

# Items: ("tele", node, seq) coalesce per node; ("event", node, seq) never do.


def key(item: tuple[str, str, int]) -> str | None:
    return item[1] if item[0] == "tele" else None


def drain(q: CoalescingQueue) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_latest_sample_per_node_wins_and_keeps_its_turn() -> None:
    superseded: list = []
    q = CoalescingQueue(key=key, on_superseded=superseded.append)
    for item in [("tele", "a", 1), ("tele", "b", 1), ("tele", "a", 2), ("tele", "a", 3), ("tele", "b", 2)]:
        q.put_nowait(item)
    assert q.qsize() == 2 and q.pending_keys() == 2
    # a first (it arrived first), with its latest sample; b's latest after it.
    assert drain(q) == [("tele", "a", 3), ("tele", "b", 2)]
    assert q.superseded == 3 and superseded == [("tele", "a", 1), ("tele", "a", 2), ("tele", "b", 1)]
    # Once taken, a node's next sample queues again (coalescing only while one is pending).
    q.put_nowait(("tele", "a", 4))
    assert drain(q) == [("tele", "a", 4)] and q.superseded == 3


def test_events_keep_their_order_and_are_never_superseded() -> None:
    q = CoalescingQueue(key=key)
    items = [
        ("event", "a", 1),
        ("tele", "a", 1),
        ("event", "a", 2),
        ("tele", "a", 2),
        ("event", "a", 2),
        ("event", "b", 3),
    ]
    for item in items:
        q.put_nowait(item)
    out = drain(q)
    # Every event, duplicates included (the registry de-duplicates, not the inbox), in order.
    assert [i for i in out if i[0] == "event"] == [i for i in items if i[0] == "event"]
    assert [i for i in out if i[0] == "tele"] == [("tele", "a", 2)]
    assert q.superseded == 1


def test_an_event_is_served_before_every_waiting_sample() -> None:
    """A notice that arrives behind 2,000 nodes' samples is handled next, not after them."""
    q = CoalescingQueue(key=key)
    for n in range(2000):
        q.put_nowait(("tele", f"n{n}", 1))
    q.put_nowait(("event", "n7", 1))
    q.put_nowait(("event", "n8", 2))
    assert q.get_nowait() == ("event", "n7", 1)
    assert q.get_nowait() == ("event", "n8", 2)
    assert q.get_nowait() == ("tele", "n0", 1)  # then the samples, in their order
    assert q.qsize() == 1999 and q.pending_keys() == 1999


async def test_a_waiting_getter_is_woken_by_a_put() -> None:
    q = CoalescingQueue(key=key)
    getter = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    q.put_nowait(("tele", "a", 1))
    assert await asyncio.wait_for(getter, 5) == ("tele", "a", 1)


items = st.lists(
    st.tuples(st.sampled_from(["tele", "event"]), st.sampled_from("abcdefgh"), st.integers(0, 10**6)), max_size=300
)


@given(items, st.integers(1, 50))
def test_property_bounded_nothing_lost_but_superseded_samples(xs: list, take_every: int) -> None:
    """Interleaved puts and gets: at most one pending sample per node; every event comes out once
    and in order; each node's samples come out in order, and only superseded ones go missing
    (put = taken + superseded + still pending)."""
    q = CoalescingQueue(key=key)
    out: list = []
    for n, x in enumerate(xs):
        q.put_nowait(x)
        assert q.pending_keys() <= len({i[1] for i in xs})
        assert q.qsize() == q.pending_keys() + len(q._queue.events)
        if n % take_every == 0:
            out.append(q.get_nowait())
    out += drain(q)
    assert [i for i in out if i[0] == "event"] == [i for i in xs if i[0] == "event"]
    teles = [i for i in xs if i[0] == "tele"]
    taken = [i for i in out if i[0] == "tele"]
    assert len(taken) + q.superseded == len(teles)
    for node in "abcdefgh":
        sent = [i for i in teles if i[1] == node]
        got = [i for i in taken if i[1] == node]
        # A subsequence of what the node sent, ending with its last sample.
        it = iter(sent)
        assert all(any(g is s for s in it) for g in got)
        assert (got[-1] is sent[-1]) if sent else not got
