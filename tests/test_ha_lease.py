"""Leader election by lease: the pure decisions (fleetd/policy/lease.py), and a property: however the
hosts' steps, writes and pauses interleave, never two hosts lead at the same instant."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as hs

from fleetd.policy import lease
from fleetd.policy.lease import LeaseRecord, LeaseState, LeaseTiming, Step

T = LeaseTiming.for_lease(6.0)  # renew every 2 s, stop acting 1.5 s before the lease could expire


def test_first_host_acquires_generation_1_and_renews_it() -> None:
    s, why = lease.observe("a", LeaseState(), None, 0.0)
    d = lease.decide("a", s, 0.0, T, "v1")
    assert (d.step, d.expect, d.write) == (Step.ACQUIRE, None, LeaseRecord("a", 1, "v1"))
    s, _ = lease.after_write(s, d, True, 0.0, T)
    assert s.leads(0.0) and s.leads(4.49) and not s.leads(4.5)  # 6 s lease - 1.5 s guard
    s, why = lease.observe("a", s, LeaseRecord("a", 1, "v1"), 2.0)
    d = lease.decide("a", s, 2.0, T, "v2")
    assert why is None and (d.step, d.write) == (Step.RENEW, LeaseRecord("a", 1, "v2"))


def test_a_standby_waits_a_whole_lease_of_silence_by_its_own_clock_then_bumps_the_generation() -> None:
    rec = LeaseRecord("a", 3, "v9")
    s, _ = lease.observe("b", LeaseState(), rec, 100.0)
    assert lease.decide("b", s, 100.0, T, "x").step is Step.WAIT
    s, _ = lease.observe("b", s, rec, 105.9)
    assert lease.decide("b", s, 105.9, T, "x").step is Step.WAIT
    s, _ = lease.observe("b", s, LeaseRecord("a", 3, "v10"), 106.0)  # renewed: the watch starts again
    assert lease.decide("b", s, 111.9, T, "x").step is Step.WAIT
    d = lease.decide("b", s, 112.0, T, "w")
    assert (d.step, d.expect, d.write) == (Step.ACQUIRE, LeaseRecord("a", 3, "v10"), LeaseRecord("b", 4, "w"))


def test_a_released_lease_is_taken_at_once() -> None:
    s, _ = lease.observe("b", LeaseState(), LeaseRecord("", 3, "r"), 0.0)
    d = lease.decide("b", s, 0.0, T, "w")
    assert (d.step, d.write) == (Step.ACQUIRE, LeaseRecord("b", 4, "w"))


def test_the_holder_loses_when_another_holds_the_record_or_its_own_lease_ran_out() -> None:
    d = lease.decide("a", LeaseState(), 0.0, T, "v1")
    held, _ = lease.after_write(LeaseState(), d, True, 0.0, T)
    s, why = lease.observe("a", held, LeaseRecord("b", 2, "w"), 1.0)
    assert why == "another host took the lease" and not s.leads(1.0)
    s, why = lease.observe("a", held, LeaseRecord("a", 1, "v1"), 5.0)  # woke up after a pause
    assert why == "lease expired before a renewal succeeded" and s.held is None
    renew = lease.decide("a", held, 1.0, T, "v2")
    s, why = lease.after_write(held, renew, False, 1.0, T)
    assert why is not None and s == LeaseState()


# -- the property: a simulated store with conditional writes, two or three hosts -----------------
class Store:
    def __init__(self) -> None:
        self.record: LeaseRecord | None = None

    def put(self, write: LeaseRecord, expect: LeaseRecord | None) -> bool:
        if self.record != expect:
            return False
        self.record = write
        return True


# Each event: (host, what, delay): a host reads-and-decides ("step"), or pauses for a while
# (GC, SIGSTOP, a slow network: its write may land late, after the pause).
events = hs.lists(
    hs.tuples(hs.integers(0, 2), hs.sampled_from(["step", "step", "step", "pause"]), hs.floats(0.0, 9.0)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(events)
def test_never_two_leaders_at_once(schedule: list[tuple[int, str, float]]) -> None:
    store = Store()
    states = [LeaseState() for _ in range(3)]
    names = ["a", "b", "c"]
    now = 0.0
    version = 0
    generations_seen: dict[int, str] = {}
    for host, what, delay in schedule:
        now += delay if what == "pause" else min(delay, T.renew_every_s)
        s, _ = lease.observe(names[host], states[host], store.record, now)
        version += 1
        d = lease.decide(names[host], s, now, T, f"v{version}")
        if d.write is not None:
            started = now
            if what == "pause":
                now += delay  # the write is delivered after a pause: it must still be safe
            ok = store.put(d.write, d.expect)
            s, _ = lease.after_write(s, d, ok, started, T)
            if ok:
                # A generation belongs to one host only (the fence).
                assert generations_seen.setdefault(d.write.generation, names[host]) == names[host]
        states[host] = s
        leaders = [n for n, st in zip(names, states, strict=True) if st.leads(now)]
        assert len(leaders) <= 1, (leaders, now, store.record)
        # Whoever leads holds the generation the store names (its fenced writes pass).
        for n, st in zip(names, states, strict=True):
            if st.leads(now):
                assert store.record is not None and (store.record.holder, store.record.generation) == (n, st.held)
