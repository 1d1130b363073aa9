"""torchrun's rendezvous state as plain data: the codec against torch's own classes, the edits
fleetd makes, and the pure steering decisions."""

from __future__ import annotations

import base64
import os
import pickle
from datetime import UTC, datetime, timedelta

import pytest
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _RendezvousState,
    _RendezvousStateHolder,
)

from fleetd.rendezvous import decide
from fleetd.rendezvous.errors import RendezvousStateError
from fleetd.rendezvous.state import MARKER_ADDR, NULL_SENTINEL, NodeId, RendezvousState, decode, encode

NOW = datetime(2026, 11, 21, 6, 0, tzinfo=UTC)
A, B, C = NodeId("127.0.0.2", 100, 0), NodeId("127.0.0.3", 200, 0), NodeId("127.0.0.4", 300, 0)


def torch_state(**fields) -> _RendezvousState:
    s = _RendezvousState()
    for k, v in fields.items():
        setattr(s, k, v)
    return s


def raw(s: _RendezvousState) -> bytes:
    return base64.b64encode(pickle.dumps(s))


def desc(n: NodeId) -> _NodeDesc:
    return _NodeDesc(n.addr, n.pid, n.local_id)


def complete_round(*nodes: NodeId, rnd: int = 3) -> RendezvousState:
    return RendezvousState(
        round=rnd,
        complete=True,
        participants={n: i for i, n in enumerate(sorted(nodes))},
        last_heartbeats={n: NOW for n in nodes},
    )


# ---------------------------------------------------------------------- codec
def test_decodes_what_torch_writes():
    t = torch_state(
        round=4,
        complete=True,
        closed=False,
        participants={desc(A): 0, desc(B): 1},
        wait_list={desc(C)},
        last_heartbeats={desc(A): NOW, desc(B): NOW, desc(C): NOW},
    )
    s = decode(raw(t))
    assert s is not None
    assert (s.round, s.complete, s.closed) == (4, True, False)
    assert s.participants == {A: 0, B: 1}
    assert s.waiting == {C}
    assert s.participant_addrs == {"127.0.0.2", "127.0.0.3"}


def test_encode_round_trips_through_torch_objects():
    s = complete_round(A, B).with_marker(NOW, 3)
    back = pickle.loads(base64.b64decode(encode(s)))
    assert isinstance(back, _RendezvousState)
    assert back.participants == {desc(A): 0, desc(B): 1}
    assert decode(encode(s)) == s


def test_empty_sentinel_means_no_state():
    assert decode(NULL_SENTINEL) is None


def test_refuses_to_unpickle_anything_but_torchs_classes():
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with pytest.raises(RendezvousStateError, match="not allowed"):
        decode(base64.b64encode(pickle.dumps(Evil())))


@pytest.mark.parametrize(
    "value", [b"not base64!!", base64.b64encode(b"not a pickle"), base64.b64encode(pickle.dumps(42))]
)
def test_corrupt_state_is_a_clear_error(value):
    with pytest.raises(RendezvousStateError):
        decode(value)


# ---------------------------------------------------------------------- transforms
def test_removing_a_participant_keeps_the_round_for_the_others():
    s = complete_round(A, B, C).without_addrs({"127.0.0.4"})
    assert s.participants.keys() == {A, B} and C not in s.last_heartbeats
    assert s.complete and s.round == 3


def test_removing_the_last_participant_opens_the_next_round_like_torch():
    s = complete_round(A).without_addrs({"127.0.0.2"})
    assert (s.round, s.complete) == (4, False)


def test_incomplete_round_below_min_nodes_loses_its_deadline():
    s = RendezvousState(round=1, participants={A: 0, B: 0}, deadline=NOW, last_heartbeats={A: NOW, B: NOW})
    assert s.without_addrs({"127.0.0.3"}, min_nodes=2).deadline is None


def test_completed_assigns_ranks_in_torchs_order():
    s = RendezvousState(round=2, participants={C: 0, A: 0, B: 0}, deadline=NOW)
    done = s.completed()
    assert done.complete and done.deadline is None
    assert done.participants == {A: 0, B: 1, C: 2}
    # the same as torch's own _mark_rendezvous_complete
    t = torch_state(round=2, participants={desc(C): 0, desc(A): 0, desc(B): 0})
    settings = RendezvousSettings("r", 1, 4, RendezvousTimeout(), timedelta(seconds=1), 3)
    ex = _DistributedRendezvousOpExecutor.__new__(_DistributedRendezvousOpExecutor)
    ex._state, ex._node, ex._settings = t, desc(A), settings
    ex._record = lambda **kw: None
    ex._mark_rendezvous_complete()
    assert {NodeId(n.addr, n.pid, n.local_id): r for n, r in t.participants.items()} == done.participants


def test_marker_counts_as_waiting_for_torch_but_not_for_fleetd():
    s = complete_round(A, B).with_marker(NOW, 3)
    assert s.has_marker and s.waiting == frozenset()
    assert len(pickle.loads(base64.b64decode(encode(s))).wait_list) == 1  # torch sees 1 waiting
    assert not s.without_markers().has_marker


# ---------------------------------------------------------------------- decisions
def obs(state, **kw) -> decide.Observation:
    kw.setdefault("members", state.participant_addrs if state is not None and state.complete else None)
    return decide.Observation(state=state, now=NOW, **kw)


def kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


def test_drain_ready_node_is_removed_and_told_to_leave():
    acts = decide.steer(obs(complete_round(A, B, C), drain_ready=frozenset({"127.0.0.4"})))
    assert kinds(acts) == ["RemoveNodes", "TellLeave"]
    assert acts[0].addrs == {"127.0.0.4"} and acts[1].addr == "127.0.0.4"
    assert all(a.reason for a in acts)


def test_survivors_are_poked_once_the_leaver_left():
    s = complete_round(A, B)
    told = {"127.0.0.4": NOW - timedelta(seconds=0.2)}
    assert decide.steer(obs(s, told_leave=told)) == ()  # still stopping its tree
    acts = decide.steer(obs(s, told_leave=told, left=frozenset({"127.0.0.4"})))
    assert kinds(acts) == ["PokeSurvivors"] and acts[0].finished == {"127.0.0.4"}


def test_survivors_still_writing_the_held_step_are_poked_only_once_saved():
    """A leaver with replicated state left at the hold without waiting for their save
    (agent/trainer/hold_plan.py): a poke now would restart their workers mid-save."""
    s = complete_round(A, B)
    told = {"127.0.0.4": NOW - timedelta(seconds=1)}
    left = frozenset({"127.0.0.4"})
    assert decide.steer(obs(s, told_leave=told, left=left, saving=frozenset({B.addr}))) == ()
    assert kinds(decide.steer(obs(s, told_leave=told, left=left))) == ["PokeSurvivors"]
    # Bounded: a member that never acknowledges (it died meanwhile) does not hold the rest.
    late = {"127.0.0.4": NOW - timedelta(seconds=31)}
    assert kinds(decide.steer(obs(s, told_leave=late, left=left, saving=frozenset({B.addr})))) == ["PokeSurvivors"]
    # A member no longer in the round is not waited for.
    assert kinds(decide.steer(obs(s, told_leave=told, left=left, saving=frozenset({"127.0.0.9"})))) == ["PokeSurvivors"]


def test_a_leaver_that_adds_itself_back_to_the_open_round_is_taken_out_again():
    """Its torchrun was mid-join when fleetd removed it: left in, torch's last call would complete
    the round with it as rank 0 and the others would wait for an address it never publishes."""
    leaver = NodeId("127.0.0.1", 50, 0)  # sorts first: rank 0 if the round completed with it
    s = RendezvousState(round=6, participants={leaver: 0, A: 0}, last_heartbeats={leaver: NOW, A: NOW})
    told = {"127.0.0.1": NOW - timedelta(seconds=0.3)}
    acts = decide.steer(obs(s, members=frozenset({"127.0.0.1"}), told_leave=told, left=frozenset(told)))
    assert kinds(acts) == ["RemoveNodes"] and acts[0].addrs == {"127.0.0.1"}, acts
    # Once it is out, the leave finishes as usual.
    acts = decide.steer(
        obs(s.without_addrs({"127.0.0.1"}), members=frozenset({"127.0.0.1"}), told_leave=told, left=frozenset(told))
    )
    assert "RemoveNodes" not in kinds(acts) and any(isinstance(a, decide.FinishLeaves) for a in acts), acts


def test_a_leaver_that_never_trained_in_the_round_costs_the_others_no_re_form():
    """A replacement noticed while it restores asked for no hold checkpoint: the members train on."""
    s = complete_round(A, B)
    told = {"127.0.0.4": NOW - timedelta(seconds=0.2)}
    acts = decide.steer(obs(s, told_leave=told, left=frozenset({"127.0.0.4"}), member_leaves=frozenset()))
    assert kinds(acts) == ["FinishLeaves"] and acts[0].finished == {"127.0.0.4"}
    # A wave: one member and one restoring replacement leave together: one poke for both.
    told = {"127.0.0.4": NOW - timedelta(seconds=0.2), "127.0.0.5": NOW - timedelta(seconds=0.2)}
    acts = decide.steer(obs(s, told_leave=told, left=frozenset(told), member_leaves=frozenset({"127.0.0.4"})))
    assert kinds(acts) == ["PokeSurvivors"] and acts[0].finished == set(told)


def test_a_wave_of_notices_re_forms_the_survivors_once():
    """Two members noticed together: the first is out, the second's checkpoint is still being
    acknowledged. The survivors are not poked until it too has left (bounded by ``coalesce``)."""
    s = complete_round(A, B, C)  # 127.0.0.2-4
    first, second = "127.0.0.3", "127.0.0.4"
    told = {first: NOW - timedelta(seconds=0.5)}
    waiting = obs(
        s.without_addrs({first}),
        members=s.participant_addrs,
        told_leave=told,
        left=frozenset({first}),
        noticed=frozenset({first, second}),
    )
    assert decide.steer(waiting) == ()
    # The second is drain-ready: removed and told, still no poke while it stops its tree.
    ready = obs(
        s.without_addrs({first}),
        members=s.participant_addrs,
        told_leave=told,
        left=frozenset({first}),
        noticed=frozenset({first, second}),
        drain_ready=frozenset({second}),
    )
    assert kinds(decide.steer(ready)) == ["RemoveNodes", "TellLeave"]
    both = {first: NOW - timedelta(seconds=0.8), second: NOW - timedelta(seconds=0.2)}
    gone = obs(
        s.without_addrs({first, second}),
        members=s.participant_addrs - {first, second},
        told_leave=both,
        left=frozenset(both),
        noticed=frozenset(both),
    )
    acts = decide.steer(gone)
    assert kinds(acts) == ["PokeSurvivors"] and acts[0].finished == set(both)
    # A noticed member that never gets ready does not hold the survivors past the bound.
    late = obs(
        s.without_addrs({first}),
        members=s.participant_addrs,
        told_leave={first: NOW - timedelta(seconds=4)},
        left=frozenset({first}),
        noticed=frozenset({first, second}),
    )
    assert kinds(decide.steer(late)) == ["PokeSurvivors"]


def test_a_whole_fleet_wave_re_forms_nobody_while_the_rest_are_leaving_too():
    """Every node is noticed, a few seconds apart. Once the first has left, the others are still
    uploading the held step: re-forming them would train steps that die with them."""
    s = complete_round(A, B, C)
    first = "127.0.0.2"
    told = {first: NOW - timedelta(seconds=4)}  # past the coalesce bound: the others are slow
    rest = s.without_addrs({first})
    everyone = frozenset({"127.0.0.2", "127.0.0.3", "127.0.0.4"})
    acts = decide.steer(
        obs(rest, members=s.participant_addrs, told_leave=told, left=frozenset({first}), noticed=everyone)
    )
    assert kinds(acts) == ["FinishLeaves"] and acts[0].finished == {first}
    assert "leaving too" in acts[0].reason
    # A replacement already waiting is not leaving: the round re-forms, it keeps the new steps.
    newcomer = NodeId("127.0.0.9", 900, 0)
    waiting = RendezvousState(
        round=rest.round,
        complete=True,
        participants=dict(rest.participants),
        wait_list=frozenset({newcomer}),
        last_heartbeats={**rest.last_heartbeats, newcomer: NOW},
    )
    acts = decide.steer(
        obs(waiting, members=s.participant_addrs, told_leave=told, left=frozenset({first}), noticed=everyone)
    )
    assert kinds(acts) == ["PokeSurvivors"]


def test_a_leaver_that_never_confirms_is_given_up_on_after_the_timeout():
    acts = decide.steer(obs(complete_round(A, B), told_leave={"127.0.0.4": NOW - timedelta(seconds=30)}))
    assert kinds(acts) == ["PokeSurvivors"]


def test_round_completes_as_soon_as_the_expected_nodes_joined():
    forming = RendezvousState(
        round=4, participants={A: 0}, deadline=NOW + timedelta(seconds=30), last_heartbeats={A: NOW}
    )
    members = frozenset({"127.0.0.2", "127.0.0.3"})
    assert decide.steer(obs(forming, members=members)) == ()
    forming = RendezvousState(
        round=4, participants={A: 0, B: 0}, deadline=NOW + timedelta(seconds=30), last_heartbeats={A: NOW, B: NOW}
    )
    assert kinds(decide.steer(obs(forming, members=members))) == ["CompleteRound"]


def test_newcomer_in_wait_list_is_expected_too():
    forming = RendezvousState(
        round=4, participants={A: 0, B: 0}, wait_list=frozenset({C}), last_heartbeats={A: NOW, B: NOW, C: NOW}
    )
    o = obs(forming, members=frozenset({"127.0.0.2", "127.0.0.3"}))
    assert decide.expected_members(o) == {"127.0.0.2", "127.0.0.3", "127.0.0.4"}
    assert decide.steer(o) == ()


def test_without_known_members_fleetd_leaves_completion_to_torch():
    forming = RendezvousState(round=0, participants={A: 0}, last_heartbeats={A: NOW})
    assert decide.steer(obs(forming, members=None)) == ()


def test_silent_nodes_are_removed_and_not_waited_for():
    old = NOW - timedelta(seconds=10)
    s = RendezvousState(round=3, complete=True, participants={A: 0, B: 1}, last_heartbeats={A: NOW, B: old})
    acts = decide.steer(obs(s))
    # A member of the formed round went silent: the survivors hang in a collective with it, so
    # they are poked into a new round (their restart also saves the step they completed).
    assert kinds(acts) == ["RemoveNodes", "PokeSurvivors"] and acts[0].addrs == {"127.0.0.3"}
    assert acts[1].finished == frozenset() and "127.0.0.3 lost" in acts[1].reason
    # A silent newcomer that never trained with anyone hangs nobody: removed, nobody poked.
    waiting = RendezvousState(
        round=3, complete=True, participants={A: 0}, wait_list=frozenset({B}), last_heartbeats={A: NOW, B: old}
    )
    assert kinds(decide.steer(obs(waiting))) == ["RemoveNodes"]
    # Every member silent: nobody left to poke.
    alone = RendezvousState(round=3, complete=True, participants={B: 0}, last_heartbeats={B: old})
    assert kinds(decide.steer(obs(alone))) == ["RemoveNodes"]
    forming = RendezvousState(round=4, participants={A: 0}, last_heartbeats={A: NOW})
    # A member absent from the state is waited for the longer of dead_after and hang_after.
    older = NOW - timedelta(seconds=11)
    o = obs(forming, members=frozenset({"127.0.0.2", "127.0.0.3"}), heartbeats={"127.0.0.3": older})
    assert kinds(decide.steer(o)) == ["CompleteRound"]


def test_marker_from_an_earlier_round_is_dropped():
    s = complete_round(A, B, rnd=5).with_marker(NOW, 4)
    assert kinds(decide.steer(obs(s))) == ["DropMarkers"]
    assert decide.steer(obs(complete_round(A, B, rnd=5).with_marker(NOW, 5))) == ()


def test_closed_rendezvous_is_left_alone():
    closed = complete_round(A).closed_for_good()
    # fleetd closed it (the job is over): nothing more is done with it.
    assert decide.steer(obs(closed, drain_ready=frozenset({"127.0.0.2"}), closing=True)) == ()
    # Closed by anyone else (a torchrun that exited on an error): reopened, and only that.
    assert kinds(decide.steer(obs(closed, drain_ready=frozenset({"127.0.0.2"})))) == ["Reopen"]


def test_marker_addr_is_not_a_real_address():
    assert NodeId(MARKER_ADDR, 0, 1).is_marker and not A.is_marker


def test_torch_state_holder_interface_is_what_we_patch():
    # agent/supervise/torchrun_main.py shortens this default; fail loudly if torch changes it.
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _BackendRendezvousStateHolder

    assert _BackendRendezvousStateHolder.__init__.__defaults__ == (1,)
    assert RendezvousTimeout().last_call == timedelta(seconds=30)
    assert issubclass(_BackendRendezvousStateHolder, _RendezvousStateHolder) and RendezvousSettings


def test_leavers_the_survivors_formed_without_cost_no_second_re_form():
    """A wave's replacements formed a round without the noticed nodes while those still stopped
    their trees: when they report ``left``, the survivors are already training without them, and
    a poke would re-form the same nodes once more (a salvage and a second pause)."""
    from typing import cast

    from fleetd.rendezvous.client import RendezvousClient
    from fleetd.rendezvous.steering import Steerer

    steer = Steerer(client=cast(RendezvousClient, None))
    noticed = {"127.0.0.2", "127.0.0.3"}
    steer.told_members = set(noticed)  # members of the formed round when told to leave
    steer.told_leave = {a: NOW - timedelta(seconds=1) for a in noticed}
    fresh = complete_round(C, rnd=5)  # the replacement's round, formed after they were removed
    steer._note_round(fresh, NOW)
    assert steer.told_members == set()
    acts = decide.steer(
        obs(fresh, told_leave=steer.told_leave, left=frozenset(noticed), member_leaves=frozenset(steer.told_members))
    )
    assert kinds(acts) == ["FinishLeaves"], acts
    # A leaver in the round that formed (it added itself back in time) still gets its poke.
    steer.told_members = set(noticed)
    steer._note_round(complete_round(A, C, rnd=6), NOW)
    assert steer.told_members == {"127.0.0.2"}
