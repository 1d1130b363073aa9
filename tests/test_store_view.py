"""agent/trainer/store_view.py: rank 0's per-step look at the store through an outage (unit; the
real store is in tests/test_store_restart.py)."""

from __future__ import annotations

from agent.trainer.store_link import StoreLinkError
from agent.trainer.store_view import StoreView, pack, unpack


class Link:
    """Stands in for StoreLink: ``up`` and ``incarnation_now`` are the store's state."""

    def __init__(self) -> None:
        self.up, self.incarnation_now, self.seq, self.connects = True, "A", 0, 0
        self.connected = True

    def incarnation(self) -> str:
        self._check()
        return self.incarnation_now

    def latest_request_seq(self) -> int:
        self._check()
        return self.seq

    def _check(self) -> None:
        if not (self.up and self.connected):
            raise StoreLinkError("store latest failed: Broken pipe")

    def drop(self) -> None:
        self.connected = False

    def reconnect(self, timeout_s: float) -> Link:
        self.connects += 1
        if not self.up:
            raise StoreLinkError("unreachable")
        self.connected = True
        return self


def test_pack_round_trips():
    for gen, seq in ((0, 0), (0, 7), (3, 0), (5, 123456)):
        assert unpack(pack(gen, seq)) == (gen, seq)
    assert pack(1, 0) > pack(0, 10**6)  # a new store's numbers outrank the old ones in the MAX


def test_an_outage_never_raises_and_a_new_store_is_a_new_generation():
    link, events, now = Link(), [], [0.0]
    view = StoreView(link, lambda ev, **f: events.append(ev), clock=lambda: now[0])
    pulses = []
    link.seq = 4
    assert unpack(view.seen(2, lambda: pulses.append(1))) == (0, 4)

    link.up = False  # the host died: the next step sees the broken connection
    link.connected = False
    assert unpack(view.seen(4, lambda: None)) == (0, 4)  # nothing new to answer; no exception
    assert events == ["store_lost"]
    for t in (0.2, 0.5, 0.9):  # retried at most once a second
        now[0] = t
        assert unpack(view.seen(4, lambda: None)) == (0, 4)
    assert link.connects == 0
    now[0] = 1.1
    view.seen(4, lambda: None)
    assert link.connects == 1  # tried, still down

    link.up, link.incarnation_now, link.seq = True, "B", 1  # systemd restarted it: empty, numbers from 0
    now[0] = 2.2
    assert unpack(view.seen(4, lambda: None)) == (1, 1)
    assert events == ["store_lost", "store_back"] and view.generation == 1


def test_a_blip_of_the_same_store_keeps_the_generation():
    link, now = Link(), [0.0]
    view = StoreView(link, lambda ev, **f: None, clock=lambda: now[0])
    link.connected = False
    view.seen(0, lambda: None)
    now[0] = 1.5
    link.seq = 3
    assert unpack(view.seen(0, lambda: None)) == (0, 3)
