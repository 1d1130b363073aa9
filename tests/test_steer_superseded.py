"""A node's earlier torchrun left in the rendezvous beside its replacement (fleetd/rendezvous/
decide.py ``superseded``): dropped at once, by its own entry, never the live one's."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from fleetd.rendezvous import decide
from fleetd.rendezvous.state import MARKER_ADDR, NodeId, RendezvousState

NOW = datetime(2026, 11, 28, 5, 0, tzinfo=UTC)
OLD, NEW = NodeId("127.0.0.10", 100, 0), NodeId("127.0.0.10", 200, 0)
B, C = NodeId("127.0.0.11", 300, 0), NodeId("127.0.0.12", 400, 0)


def observe(state: RendezvousState, members: set[str], progress_at: datetime | None = NOW) -> decide.Observation:
    return decide.Observation(
        state=state,
        now=NOW,
        members=frozenset(members),
        heartbeats={n.addr: t for n, t in state.last_heartbeats.items()},
        progress_at=progress_at,
    )


def kinds(actions: tuple[decide.SteerAction, ...]) -> list[str]:
    return [type(a).__name__ for a in actions]


def test_a_restarted_one_node_job_drops_its_old_entry_instead_of_waiting_it_out() -> None:
    # The job's code failed; fleetd restarted the trainer: the dead torchrun is still the formed
    # round's participant (SIGTERM does not leave), its replacement waits behind it.
    s = RendezvousState(
        round=1,
        complete=True,
        participants={OLD: 0},
        wait_list=frozenset({NEW}),
        last_heartbeats={OLD: NOW - timedelta(seconds=8), NEW: NOW},
    )
    acts = decide.steer(observe(s, {OLD.addr}))
    assert kinds(acts) == ["DropSuperseded"], acts
    assert acts[0].nodes == {OLD} and "newer torchrun" in acts[0].reason
    # What the steering writes: the next round open, the replacement still listed.
    after = s.without_nodes(acts[0].nodes)
    assert not after.complete and after.round == 2 and NEW in after.wait_list
    # Once it joined that round, the round completes on the next pass.
    joined = RendezvousState(round=2, participants={NEW: 0}, last_heartbeats={NEW: NOW})
    assert kinds(decide.steer(observe(joined, {OLD.addr}))) == ["CompleteRound"]


def test_in_a_fleet_only_the_restarted_nodes_old_entry_goes_and_nobody_is_tolerated_or_removed() -> None:
    s = RendezvousState(
        round=4,
        complete=True,
        participants={OLD: 0, B: 1, C: 2},
        wait_list=frozenset({NEW}),
        last_heartbeats={OLD: NOW - timedelta(seconds=9), NEW: NOW, B: NOW, C: NOW},
    )
    acts = decide.steer(observe(s, {OLD.addr, B.addr, C.addr}))
    assert kinds(acts)[0] == "DropSuperseded" and acts[0].nodes == {OLD}
    assert "RemoveNodes" not in kinds(acts) and "TolerateStale" not in kinds(acts)


def test_without_a_heartbeat_for_both_nothing_is_dropped() -> None:
    s = RendezvousState(
        round=1, complete=True, participants={OLD: 0}, wait_list=frozenset({NEW}), last_heartbeats={OLD: NOW}
    )
    assert decide.superseded(s) == frozenset()


def test_two_handlers_of_one_torchrun_are_not_two_torchruns() -> None:
    first, second = NodeId("127.0.0.10", 100, 0), NodeId("127.0.0.10", 100, 1)
    s = RendezvousState(
        round=1,
        participants={first: 0},
        wait_list=frozenset({second}),
        last_heartbeats={first: NOW - timedelta(seconds=5), second: NOW},
    )
    assert decide.superseded(s) == frozenset()


nodes = st.builds(
    NodeId,
    addr=st.sampled_from(["127.0.0.2", "127.0.0.3", MARKER_ADDR]),
    pid=st.integers(1, 4),
    local_id=st.integers(0, 1),
)


@given(listed=st.lists(st.tuples(nodes, st.integers(0, 30), st.sampled_from(["participant", "waiting"])), max_size=8))
def test_the_freshest_entry_of_a_node_and_fleetds_markers_are_never_dropped(listed) -> None:
    participants = {n: i for i, (n, _, where) in enumerate(listed) if where == "participant"}
    waiting = frozenset(n for n, _, where in listed if where == "waiting") - set(participants)
    beats = {n: NOW - timedelta(seconds=age) for n, age, _ in listed}
    s = RendezvousState(round=1, participants=participants, wait_list=waiting, last_heartbeats=beats)
    dropped = decide.superseded(s)
    assert not any(n.is_marker for n in dropped)
    for n in dropped:
        same_node = [m for m in set(participants) | waiting if m.addr == n.addr]
        freshest = max(beats[m] for m in same_node)
        assert beats[n] < freshest  # something of the same node beat later: that one lives
        assert all(m.pid != n.pid for m in same_node if beats[m] == freshest)
