"""A member silent on both channels (decide.silent_everywhere), pure: one that froze or vanished
is removed seconds after it went quiet; one that is only slow, or cut from one channel, is not."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from fleetd.rendezvous import decide
from fleetd.rendezvous.state import NodeId, RendezvousState

NOW = datetime(2026, 11, 27, 6, 0, tzinfo=UTC)
A, B, C = NodeId("127.0.0.2", 100, 0), NodeId("127.0.0.3", 200, 0), NodeId("127.0.0.4", 300, 0)
DEAD, HANG, SILENT = timedelta(seconds=6), timedelta(seconds=10), timedelta(seconds=2.5)
ALL = frozenset({A.addr, B.addr, C.addr})


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def observe(
    *, store_b: float, broker_b: float | None, progress: float, state: RendezvousState | None = None
) -> decide.Observation:
    """B last advanced its heartbeat ``store_b`` s ago and spoke through the broker ``broker_b``
    s ago (None: no agent named its address); the job last progressed ``progress`` s ago."""
    s = state or RendezvousState(
        round=3,
        complete=True,
        participants={A: 0, B: 1, C: 2},
        last_heartbeats={A: NOW, B: ago(store_b), C: NOW},
    )
    broker = {A.addr: ago(0.3), C.addr: ago(0.5)}
    if broker_b is not None:
        broker[B.addr] = ago(broker_b)
    return decide.Observation(
        state=s,
        now=NOW,
        members=ALL,
        heartbeats={A.addr: NOW, B.addr: ago(store_b), C.addr: NOW},
        dead_after=DEAD,
        hang_after=HANG,
        progress_at=ago(progress),
        silent_after=SILENT,
        store_seen={A.addr: ago(0.2), B.addr: ago(store_b), C.addr: ago(0.4)},
        broker_seen=broker,
    )


def kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


def test_a_frozen_member_is_removed_and_survivors_poked_within_seconds():
    acts = decide.steer(observe(store_b=2.8, broker_b=2.9, progress=2.7))
    assert kinds(acts) == ["RemoveNodes", "PokeSurvivors"]
    assert acts[0].addrs == {B.addr} and "store and the broker" in acts[0].reason


def test_a_member_still_speaking_through_the_broker_waits_out_the_slow_rule():
    # A rank-0 store blip: the job stands still and the heartbeat is late, the agent reports.
    assert decide.steer(observe(store_b=4.0, broker_b=0.8, progress=4.0)) == ()


def test_a_member_still_heartbeating_is_not_lost_when_its_broker_link_is_cut():
    assert decide.steer(observe(store_b=0.9, broker_b=40.0, progress=3.0)) == ()


def test_a_quiet_member_is_kept_while_the_job_advances():
    assert decide.steer(observe(store_b=3.0, broker_b=3.0, progress=0.4)) == ()


def test_a_member_no_agent_has_named_is_left_to_the_slow_rule():
    assert decide.steer(observe(store_b=3.0, broker_b=None, progress=3.0)) == ()


def test_the_round_after_the_loss_forms_without_the_silent_member():
    """The survivors rejoin; B is gone from the state but its dead_after/hang_after grace has not
    run out: the round is still completed at once, not after max(dead_after, hang_after)."""
    forming = RendezvousState(round=4, participants={A: 0, C: 1}, last_heartbeats={A: NOW, C: NOW})
    obs = observe(store_b=3.2, broker_b=3.3, progress=3.1, state=forming)
    assert decide.expected_members(obs) == {A.addr, C.addr}
    assert "CompleteRound" in kinds(decide.steer(obs))


def test_off_without_a_threshold():
    obs = observe(store_b=3.0, broker_b=3.0, progress=3.0)
    assert decide.silent_everywhere(obs) == {B.addr}
    off = decide.Observation(**{**{f: getattr(obs, f) for f in obs.__slots__}, "silent_after": None})
    assert decide.silent_everywhere(off) == frozenset() and decide.steer(off) == ()


@given(store=st.floats(0, 30), broker=st.floats(0, 30), progress=st.floats(0, 30))
def test_a_member_is_lost_early_only_when_both_channels_and_the_job_are_quiet(store, broker, progress):
    """Property: inside the slow rule's thresholds, B is removed iff store, broker and progress
    are all older than silent_after."""
    acts = decide.steer(observe(store_b=store, broker_b=broker, progress=progress))
    removed = any(isinstance(a, decide.RemoveNodes) and B.addr in a.addrs for a in acts)
    quiet = min(store, broker, progress) > SILENT.total_seconds()
    slow_rule = store > DEAD.total_seconds() and progress > HANG.total_seconds()
    assert removed == (quiet or slow_rule)


def test_the_watch_reports_both_channels_and_the_margin_a_live_member_kept():
    from fleetd.rendezvous.silence import SilenceWatch

    heard = {A.addr: NOW.timestamp() - 0.2, B.addr: NOW.timestamp() - 1.8}
    watch = SilenceWatch(2.5, heard.get)
    watch.heartbeat_advanced(A.addr, ago(0.1))
    watch.heartbeat_advanced(B.addr, ago(1.5))
    fields = watch.observation(frozenset({A.addr, B.addr, C.addr}))
    assert fields["silent_after"] == SILENT and set(fields["broker_seen"]) == {A.addr, B.addr}
    obs = decide.Observation(state=None, now=NOW, members=ALL, **fields)
    watch.note_margin(obs, frozenset())
    assert watch.peak_quiet_s == 1.5  # B: heard 1.5 s ago on the store, 1.8 s on the broker
    watch.note_margin(obs, frozenset({B.addr}))  # a member declared lost does not count
    assert watch.peak_quiet_s == 1.5
    assert SilenceWatch(2.5, None).observation(ALL) == {} and SilenceWatch(None, heard.get).observation(ALL) == {}
