"""The steering's blip tolerance (fleetd/rendezvous/decide.py), pure: a member with a stale store
heartbeat is kept while the job advances, and removed (survivors poked) once it also stops."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from fleetd.rendezvous import decide
from fleetd.rendezvous.state import NodeId, RendezvousState

NOW = datetime(2026, 11, 24, 6, 0, tzinfo=UTC)
A, B, C = NodeId("127.0.0.2", 100, 0), NodeId("127.0.0.3", 200, 0), NodeId("127.0.0.4", 300, 0)
DEAD, HANG = timedelta(seconds=6), timedelta(seconds=10)


def formed(b_beat: datetime, *, drop_b: bool = False) -> RendezvousState:
    parts = {A: 0, C: 2} if drop_b else {A: 0, B: 1, C: 2}
    beats = {A: NOW, C: NOW} if drop_b else {A: NOW, B: b_beat, C: NOW}
    return RendezvousState(round=3, complete=True, participants=parts, last_heartbeats=beats)


def observe(state: RendezvousState, progress_at: datetime | None, b_beat: datetime) -> decide.Observation:
    return decide.Observation(
        state=state,
        now=NOW,
        members=frozenset({A.addr, B.addr, C.addr}),
        heartbeats={A.addr: NOW, B.addr: b_beat, C.addr: NOW},
        dead_after=DEAD,
        hang_after=HANG,
        progress_at=progress_at,
    )


def kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


def test_stale_member_is_kept_while_training_advances():
    b_beat = NOW - timedelta(seconds=9)  # a store blip plus TCP's retransmission backoff
    acts = decide.steer(observe(formed(b_beat), NOW - timedelta(seconds=0.4), b_beat))
    assert kinds(acts) == ["TolerateStale"] and acts[0].addrs == {B.addr}
    assert "training advances" in acts[0].reason


def test_stale_member_and_no_progress_is_removed_and_survivors_poked():
    b_beat = NOW - timedelta(seconds=12)
    acts = decide.steer(observe(formed(b_beat), NOW - timedelta(seconds=11), b_beat))
    assert kinds(acts) == ["RemoveNodes", "PokeSurvivors"]
    assert acts[0].addrs == {B.addr} and "no progress for 11 s" in acts[1].reason


def test_member_torch_already_dropped_is_still_caught_when_the_job_hangs():
    # torchrun's own keep-alive check removed B from the state; the survivors hang all the same.
    b_beat = NOW - timedelta(seconds=30)
    acts = decide.steer(observe(formed(b_beat, drop_b=True), NOW - timedelta(seconds=20), b_beat))
    assert kinds(acts) == ["PokeSurvivors"] and "127.0.0.3 lost" in acts[0].reason


def test_without_a_progress_counter_a_stale_heartbeat_alone_decides():
    b_beat = NOW - timedelta(seconds=7)
    acts = decide.steer(observe(formed(b_beat), None, b_beat))
    assert kinds(acts) == ["RemoveNodes", "PokeSurvivors"]


def test_stale_newcomer_is_removed_whatever_the_progress():
    old = NOW - timedelta(seconds=7)
    s = RendezvousState(
        round=3, complete=True, participants={A: 0}, wait_list=frozenset({B}), last_heartbeats={A: NOW, B: old}
    )
    o = decide.Observation(
        state=s,
        now=NOW,
        members=frozenset({A.addr}),
        heartbeats={A.addr: NOW, B.addr: old},
        dead_after=DEAD,
        hang_after=HANG,
        progress_at=NOW,
    )
    assert kinds(decide.steer(o)) == ["RemoveNodes"]


@given(beat_age=st.floats(0, 120), progress_age=st.floats(0, 120))
def test_a_member_is_never_removed_while_the_job_advances(beat_age, progress_age):
    """Property: removal of a formed round's member needs BOTH a stale heartbeat and a stalled job."""
    b_beat = NOW - timedelta(seconds=beat_age)
    acts = decide.steer(observe(formed(b_beat), NOW - timedelta(seconds=progress_age), b_beat))
    removed = any(isinstance(a, (decide.RemoveNodes, decide.PokeSurvivors)) for a in acts)
    assert removed == (timedelta(seconds=beat_age) > DEAD and timedelta(seconds=progress_age) > HANG)


def test_a_member_between_rounds_is_waited_for_the_longer_grace():
    """A survivor restarting after a failed collective is absent from the state for a while:
    forming the round without it would cost a second re-form right after."""
    forming = RendezvousState(round=4, participants={A: 0}, last_heartbeats={A: NOW})

    def plan_with(b_age: float):
        return decide.steer(
            decide.Observation(
                state=forming,
                now=NOW,
                members=frozenset({A.addr, B.addr}),
                heartbeats={A.addr: NOW, B.addr: NOW - timedelta(seconds=b_age)},
                dead_after=DEAD,
                hang_after=HANG,
                progress_at=NOW - timedelta(seconds=b_age),
            )
        )

    assert kinds(plan_with(8)) == []  # past dead_after, inside hang_after: still expected
    assert kinds(plan_with(11)) == ["CompleteRound"]
