"""decide.steer after a rendezvous store restart: the first round is held open for the nodes that
trained before it (pure), so a node restarting torchrun late does not make the others restart."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fleetd.rendezvous import decide
from fleetd.rendezvous.state import NodeId, RendezvousState

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
A, B, C = NodeId("127.0.0.2", 100, 0), NodeId("127.0.0.3", 200, 0), NodeId("127.0.0.4", 300, 0)
MEMBERS = frozenset({A.addr, B.addr, C.addr})


def joining(*nodes: NodeId, deadline: datetime | None) -> RendezvousState:
    return RendezvousState(
        round=0, deadline=deadline, participants={n: 0 for n in nodes}, last_heartbeats={n: NOW for n in nodes}
    )


def obs(state: RendezvousState, **kw) -> decide.Observation:  # noqa: ANN003
    return decide.Observation(state=state, now=NOW, **{"members": MEMBERS, **kw})


def test_round_held_while_a_restarting_member_is_missing():
    s = joining(A, B, deadline=NOW + timedelta(seconds=0.5))
    actions = decide.steer(obs(s, awaited=MEMBERS, awaited_until=NOW + timedelta(seconds=30)))
    holds = [a for a in actions if isinstance(a, decide.HoldRound)]
    assert len(holds) == 1 and holds[0].until == NOW + decide.HOLD_STEP and C.addr in holds[0].reason
    assert not any(isinstance(a, decide.CompleteRound) for a in actions)


def test_all_back_completes_at_once_without_a_hold():
    s = joining(A, B, C, deadline=NOW + timedelta(seconds=0.5))
    actions = decide.steer(obs(s, awaited=MEMBERS, awaited_until=NOW + timedelta(seconds=30)))
    assert [type(a) for a in actions] == [decide.CompleteRound]


def test_hold_ends_at_its_bound_and_never_without_one():
    s = joining(A, B, deadline=NOW + timedelta(seconds=0.5))
    assert not any(
        isinstance(a, decide.HoldRound)
        for a in decide.steer(obs(s, awaited=MEMBERS, awaited_until=NOW - timedelta(seconds=1)))
    )
    assert not any(isinstance(a, decide.HoldRound) for a in decide.steer(obs(s)))  # no store restart: as before


def test_hold_never_moves_the_deadline_past_its_bound_or_back():
    bound = NOW + timedelta(seconds=1)
    s = joining(A, deadline=NOW + timedelta(seconds=0.2))
    (hold,) = [a for a in decide.steer(obs(s, awaited=MEMBERS, awaited_until=bound)) if isinstance(a, decide.HoldRound)]
    assert hold.until == bound
    later = joining(A, deadline=NOW + timedelta(seconds=1.9))
    assert not any(
        isinstance(a, decide.HoldRound)
        for a in decide.steer(obs(later, awaited=MEMBERS, awaited_until=NOW + timedelta(seconds=30)))
    )


def test_a_late_heartbeat_during_the_hold_is_not_a_lost_node():
    s = RendezvousState(
        round=0,
        deadline=NOW + timedelta(seconds=0.5),
        participants={A: 0, B: 0},
        last_heartbeats={A: NOW, B: NOW - timedelta(seconds=20)},
    )
    held = decide.steer(obs(s, awaited=MEMBERS, awaited_until=NOW + timedelta(seconds=30)))
    assert not any(isinstance(a, decide.RemoveNodes) for a in held)
    after = decide.steer(obs(s, awaited=MEMBERS, awaited_until=NOW - timedelta(seconds=1)))
    assert any(isinstance(a, decide.RemoveNodes) and B.addr in a.addrs for a in after)


def test_a_rendezvous_closed_by_a_crashed_torchrun_is_reopened_unless_fleetd_closed_it():
    """torch closes its rendezvous when one torchrun exits by an exception (not a signal): every
    later join then fails with RendezvousClosedError, and a job retried after a bug in its code
    lost a node for good. Only fleetd ends a job."""
    closed = RendezvousState(round=3, complete=True, closed=True, participants={A: 0})
    (action,) = decide.steer(obs(closed))
    assert isinstance(action, decide.Reopen)
    assert decide.steer(obs(closed, closing=True)) == ()


async def test_the_steering_reopens_it_in_the_store():
    from dataclasses import replace

    from fleetd.rendezvous.steering import Steerer

    class Store:
        def __init__(self, state: RendezvousState) -> None:
            self.state = state

        async def update(self, change):  # noqa: ANN001, ANN202 - the client's CAS loop, in memory
            new = change(self.state)
            if new is not None:
                self.state = new
            return new

    store = Store(RendezvousState(round=3, complete=True, closed=True, participants={A: 0}))
    steerer = Steerer(store)  # type: ignore[arg-type]
    await steerer.apply(decide.Reopen("test"), obs(store.state))
    assert store.state == replace(store.state, closed=False) and not store.state.closed
    await steerer.close_rendezvous()
    assert store.state.closed and steerer.closing


def test_a_round_of_nodes_that_are_all_leaving_is_held_not_formed():
    """A whole-fleet wave: the first leaver's exit broke the others' collective, torchrun restarted
    them into a new round while their agents still upload the held step. Formed, that round
    trained steps that died with them (the storm demo lost 21 on a loaded box)."""
    s = joining(A, B, deadline=NOW + timedelta(seconds=0.5))
    leaving = decide.steer(obs(s, members=frozenset({A.addr, B.addr}), noticed=frozenset({A.addr, B.addr})))
    (hold,) = [a for a in leaving if isinstance(a, decide.HoldRound)]
    assert hold.until == NOW + decide.HOLD_STEP and "every node in it is leaving" in hold.reason
    assert not any(isinstance(a, decide.CompleteRound) for a in leaving)
    # Not pushed again while the deadline is far enough ahead.
    later = joining(A, B, deadline=NOW + timedelta(seconds=1.9))
    assert not decide.steer(obs(later, members=frozenset({A.addr, B.addr}), noticed=frozenset({A.addr, B.addr})))
    # One node that is staying (a replacement, a survivor) and the round forms as before.
    staying = decide.steer(obs(s, members=frozenset({A.addr, B.addr}), noticed=frozenset({A.addr})))
    assert [type(a) for a in staying] == [decide.CompleteRound]
