"""What fleetd does to the rendezvous in one steering pass: a pure function of what it observed.

Level-based (every pass re-reads the store), each node's phase read from its keys: a leaver's
``drain_ready`` -> RemoveNode + TellLeave; its ``left`` (or none in time) and the staying members'
copies of the held step -> PokeSurvivors; the survivors and waiting newcomers all in ->
CompleteRound. A stale member is kept while the job's progress counter moves (docs/DESIGN.md
"One interruption, end to end", "Partitions: signals from independent sources").
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from fleetd.protocol.interruption import OUT, Phase, store_phase
from fleetd.protocol.rendezvous_keys import HELD_SAVE_WAIT_S
from fleetd.rendezvous.state import MARKER_ADDR, NodeId, RendezvousState


@dataclass(frozen=True, slots=True)
class Observation:
    state: RendezvousState | None
    now: datetime
    # Participants of the last complete round fleetd saw (None: not known yet, e.g. just adopted).
    members: frozenset[str] | None
    drain_ready: frozenset[str] = frozenset()  # nodes whose agent reported a durable shard
    told_leave: dict[str, datetime] = field(default_factory=dict)  # when fleetd told them
    left: frozenset[str] = frozenset()  # nodes whose agent confirmed the tree is stopped
    # Newest heartbeat fleetd has seen per address, across passes: a node briefly has none in the
    # state while it moves from the old round to the new one; a dead node's only gets older.
    heartbeats: dict[str, datetime] = field(default_factory=dict)
    min_nodes: int = 1
    max_nodes: int = 1 << 30
    left_timeout: timedelta = timedelta(seconds=5)
    dead_after: timedelta = timedelta(seconds=6)
    # After a store restart every node restarts torchrun, a few seconds apart. torchrun completes
    # a round ``last_call`` after its first joiner: whoever restarted late would then make all
    # the others restart once more. Hold the round open for these nodes until ``awaited_until``.
    awaited: frozenset[str] = frozenset()
    awaited_until: datetime | None = None
    # Leavers that were members of the formed round when fleetd told them to leave (None: not
    # known, treat every leaver as one). A leaver that never trained in it (a replacement noticed
    # while it restores) asked for no hold checkpoint: its leave needs no re-form of the others.
    member_leaves: frozenset[str] | None = None
    # Members whose agent started a notice flow (a wave): their checkpoint is being acknowledged
    # and their drain_ready follows within moments. The survivors' re-form waits for them, up to
    # ``coalesce`` after the first leaver was told, so that a wave costs one re-form, not one per
    # leaver (kept below the trainers' own LEFT_GRACE_S, after which they re-form by themselves).
    noticed: frozenset[str] = frozenset()
    coalesce: timedelta = timedelta(seconds=3)
    # Members that stay and have not saved the step their leavers held (agent/trainer/hold_plan.py):
    # a poke would stop their workers mid-save. Waited for up to ``save_wait`` after the first told.
    saving: frozenset[str] = frozenset()
    save_wait: timedelta = timedelta(seconds=HELD_SAVE_WAIT_S)
    # When the steering last saw the job's progress counter change (None: no counter in the
    # store, so progress cannot be judged and a stale heartbeat alone decides).
    progress_at: datetime | None = None
    hang_after: timedelta = timedelta(seconds=10)
    # A node that vanished or froze goes quiet on every channel at once; one that is only slow,
    # or cut from one of them, still speaks on the other. So a member fleetd has heard nothing
    # from for ``silent_after`` on both independent channels (its rendezvous heartbeat advancing,
    # its agent's messages through the broker; both on fleetd's own clock), while the job made no
    # progress for as long, is lost at once, without waiting out dead_after and hang_after
    # (docs/DESIGN.md "Partitions: signals from independent sources"). None: off.
    silent_after: timedelta | None = None
    store_seen: dict[str, datetime] = field(default_factory=dict)
    broker_seen: dict[str, datetime] = field(default_factory=dict)
    # fleetd itself closed the rendezvous (the job is over): a closed state stays closed.
    closing: bool = False

    def phase(self, addr: str) -> Phase | None:
        """The node's interruption phase as its keys show it (fleetd's own leave is ``told_leave``;
        ``left`` is read only for nodes told to leave)."""
        return store_phase(
            noticed=addr in self.noticed,
            drain_ready=addr in self.drain_ready,
            leave=addr in self.told_leave,
            left=addr in self.left,
        )

    def in_phase(self, *phases: Phase) -> frozenset[str]:
        """Every node with an interruption under way whose phase is one of ``phases``."""
        leaving = self.noticed | self.drain_ready | frozenset(self.told_leave) | self.left
        return frozenset(a for a in leaving if self.phase(a) in phases)


@dataclass(frozen=True, slots=True)
class SteerAction:
    reason: str


@dataclass(frozen=True, slots=True)
class RemoveNodes(SteerAction):
    addrs: frozenset[str]


@dataclass(frozen=True, slots=True)
class DropSuperseded(SteerAction):
    """A node's earlier torchrun, still listed beside the one that replaced it."""

    nodes: frozenset[NodeId]


@dataclass(frozen=True, slots=True)
class TellLeave(SteerAction):
    addr: str


@dataclass(frozen=True, slots=True)
class PokeSurvivors(SteerAction):
    finished: frozenset[str]  # leaves this poke completes (fleetd forgets them afterwards)


@dataclass(frozen=True, slots=True)
class FinishLeaves(SteerAction):
    finished: frozenset[str]  # survivors are already re-forming without a poke


@dataclass(frozen=True, slots=True)
class TolerateStale(SteerAction):
    """Members with stale heartbeats kept because the job still advances (logged, not applied)."""

    addrs: frozenset[str]


@dataclass(frozen=True, slots=True)
class CompleteRound(SteerAction):
    pass


@dataclass(frozen=True, slots=True)
class Reopen(SteerAction):
    """A torchrun that exits by an exception (not a signal) closes torch's rendezvous for every
    node: each later join fails with RendezvousClosedError. Only fleetd ends a job."""


@dataclass(frozen=True, slots=True)
class DropMarkers(SteerAction):
    pass


@dataclass(frozen=True, slots=True)
class HoldRound(SteerAction):
    until: datetime  # the round's new last-call deadline


HOLD_STEP = timedelta(seconds=2)  # push the deadline this far ahead, a pass at a time


def _holding(obs: Observation) -> bool:
    return bool(obs.awaited) and obs.awaited_until is not None and obs.now < obs.awaited_until


def expected_members(obs: Observation) -> frozenset[str] | None:
    """Who should be in the round being formed: last members, minus leavers, plus newcomers."""
    s = obs.state
    if s is None or obs.members is None:
        return None
    gone = obs.in_phase(*OUT)
    stale = {n.addr for n in s.stale(obs.now, obs.dead_after)}
    # A member absent from the state is between rounds: its agent left the old one and has not
    # joined this one yet. After a failed collective that took a survivor 6-9 s on the loaded
    # test box (bench/partitions.py); forming without it costs a second re-form right after, so
    # it gets the longer of the two thresholds. A silent node still in the state gets dead_after.
    in_state = {n.addr for n in s.last_heartbeats}
    grace = max(obs.dead_after, obs.hang_after)
    stale |= {
        a for a in obs.members if a in obs.heartbeats and a not in in_state and obs.now - obs.heartbeats[a] > grace
    }
    if _holding(obs):
        stale -= obs.awaited
    stale |= silent_everywhere(obs)
    waiting = {n.addr for n in s.waiting}
    return frozenset((obs.members - gone - stale) | waiting)


def wave_still_coming(obs: Observation, present: frozenset[str] | set[str]) -> frozenset[str]:
    """Members of the round in a notice flow that are not drain-ready or told to leave yet."""
    members = obs.members or frozenset()
    return obs.in_phase(Phase.NOTICED) & members & frozenset(present)


def silent_everywhere(obs: Observation) -> frozenset[str]:
    """Members quiet on both channels for ``silent_after`` while the job stands still. A member
    either channel has never named (no mapping yet) is left to the slower rule."""
    if obs.silent_after is None or obs.members is None or obs.progress_at is None:
        return frozenset()
    quiet_since = obs.now - obs.silent_after
    if obs.progress_at >= quiet_since:
        return frozenset()
    lost = frozenset(
        a
        for a in obs.members
        if (store := obs.store_seen.get(a)) is not None
        and store < quiet_since
        and (broker := obs.broker_seen.get(a)) is not None
        and broker < quiet_since
    )
    return lost - obs.awaited if _holding(obs) else lost


def job_hung(obs: Observation) -> bool:
    """No progress for ``hang_after`` (or no progress counter to judge by)."""
    return obs.progress_at is None or obs.now - obs.progress_at > obs.hang_after


def _stale_members(obs: Observation) -> frozenset[str]:
    """Members of the formed round whose newest heartbeat (across passes) is stale. This also
    catches a member torchrun's own keep-alive check already dropped from the state."""
    s = obs.state
    if s is None or not s.complete or obs.members is None:
        return frozenset()
    stale = {n.addr for n in s.stale(obs.now, obs.dead_after)} & s.participant_addrs
    stale |= {a for a in obs.members if a in obs.heartbeats and obs.now - obs.heartbeats[a] > obs.dead_after}
    return frozenset(stale)


def steer(obs: Observation) -> tuple[SteerAction, ...]:
    """The steering's actions for one look at the store: lost members, leaving ones, the round."""
    s = obs.state
    if s is None:
        return ()
    if s.closed:
        if obs.closing:
            return ()
        return (Reopen("closed by a torchrun that exited on an error; only fleetd ends the job"),)
    dropped: tuple[SteerAction, ...] = ()
    if old := superseded(s):
        addrs = ", ".join(sorted({n.addr for n in old}))
        dropped = (DropSuperseded(f"{addrs}: a newer torchrun of the node joined; the older one is gone", old),)
        s = s.without_nodes(old, obs.min_nodes)
        obs = replace(obs, state=s)
    present = s.participant_addrs | {n.addr for n in s.wait_list if n.addr != MARKER_ADDR}
    return (*dropped, *_losses(obs, s, present), *_leaves(obs, s, present), *_round(obs, s))


def superseded(s: RendezvousState) -> frozenset[NodeId]:
    """Entries of a node's earlier torchrun while a later one of the same node is listed too.

    An agent starts a node's next torchrun only once the last has exited (agent/supervise/
    elastic_run.py), and SIGTERM does not take torchrun out of the rendezvous: after a job
    restart, a store outage or a stall recovery, the old entry (a participant of the last round)
    stayed until its heartbeat went stale and training stopped advancing, 9-15 s in which the
    new torchrun sat wait-listed behind it (a failing one-node job's restarts, 2026-11-28). The
    entry with the newest heartbeat is the live one (one node, one clock); the others are dead."""
    by_addr: dict[str, list[NodeId]] = {}
    for n in set(s.participants) | s.wait_list | s.redundancy_list:
        if not n.is_marker:
            by_addr.setdefault(n.addr, []).append(n)
    old: set[NodeId] = set()
    for nodes in by_addr.values():
        if len({n.pid for n in nodes}) < 2:
            continue
        beat = {n: t for n in nodes if (t := s.last_heartbeats.get(n)) is not None}
        if len(beat) < len(nodes):
            continue  # no heartbeat to tell them apart by: leave it to the stale rule
        newest = max(beat, key=beat.__getitem__)
        old |= {n for n in nodes if n.pid != newest.pid and beat[n] < beat[newest]}
    return frozenset(old)


def _losses(obs: Observation, s: RendezvousState, present: frozenset[str]) -> list[SteerAction]:
    """Members whose heartbeat is stale: tolerated while training advances, else removed."""
    actions: list[SteerAction] = []
    stale = frozenset(n.addr for n in s.stale(obs.now, obs.dead_after)) & present
    if _holding(obs):
        # Nodes rejoining after a store restart start torchrun and its keep-alive thread under
        # load; a late heartbeat then is not a lost node. One that is really gone is removed when
        # the hold ends (restart_hold_s), and its absence never completes the round before that.
        stale -= obs.awaited
    stale_members = _stale_members(obs)
    if _holding(obs):
        stale_members -= obs.awaited
    gone = silent_everywhere(obs)
    blips = stale_members - gone
    if blips and not job_hung(obs):
        # One connection's silence while the job advances: a blip, not a loss (module docstring).
        actions.append(
            TolerateStale(
                f"{', '.join(sorted(blips))}: no heartbeat for over {obs.dead_after.total_seconds():g} s "
                "but training advances; kept",
                blips,
            )
        )
        stale -= blips
        stale_members = gone
    if gone & present:
        assert obs.silent_after is not None  # silent_everywhere is empty without it
        quiet = obs.silent_after.total_seconds()
        actions.append(RemoveNodes(f"silent on the store and the broker for over {quiet:g} s", gone & present))
    stale -= gone
    stale_members |= gone
    if stale:
        actions.append(RemoveNodes(f"no heartbeat for over {obs.dead_after.total_seconds():g} s", stale))
    if stale_members and s.complete and s.participant_addrs - stale_members and not s.has_marker:
        why = (
            ""
            if obs.progress_at is None
            else (f" and no progress for {(obs.now - obs.progress_at).total_seconds():.0f} s")
        )
        actions.append(
            PokeSurvivors(f"{', '.join(sorted(stale_members))} lost{why}: survivors re-form now", frozenset())
        )
    return actions


def _leaves(obs: Observation, s: RendezvousState, present: frozenset[str]) -> list[SteerAction]:
    """Drained nodes told to leave, and the survivors re-formed once every one told has left."""
    actions: list[SteerAction] = []
    ready = obs.in_phase(Phase.DRAIN_READY)  # drained, not told to leave yet
    for addr in sorted(ready):
        if addr in present:
            actions.append(RemoveNodes(f"{addr} is draining and its checkpoint is saved", frozenset({addr})))
        actions.append(TellLeave(f"{addr} removed from the rendezvous; stop its process tree", addr))
    if not obs.told_leave:
        return actions
    # Removed once, a leaver's torchrun can still add itself back in the moments before its agent
    # stops it (it was mid-join, the round open); torch then completed the round at its last call
    # with the leaver as rank 0, and the others waited 60 s for an address it never published
    # (the storm demo, 2026-11-28). Taken out again each pass: 50 ms against a 2 s last call.
    for addr in sorted(frozenset(obs.told_leave) & present):
        actions.append(RemoveNodes(f"{addr} joined again after it was told to leave", frozenset({addr})))
    done = frozenset(
        a for a, told in obs.told_leave.items() if obs.phase(a) is Phase.LEFT or obs.now - told > obs.left_timeout
    )
    if done != frozenset(obs.told_leave) or (done & present):
        return actions
    members_left = done if obs.member_leaves is None else done & obs.member_leaves
    coming = wave_still_coming(obs, present)
    if not members_left:
        actions.append(FinishLeaves(f"{', '.join(sorted(done))} left, not in the round training now: no re-form", done))
    elif ready:
        pass  # more leavers are told this very pass: they join this re-form
    elif coming and obs.now - min(obs.told_leave.values()) < obs.coalesce:
        pass  # the rest of the wave is about to be drain-ready: one re-form for all of it
    elif present and not (present - obs.noticed):
        # Everyone still here is leaving too (a whole-fleet wave): a re-form would train
        # steps that die with them while their agents upload the held step.
        actions.append(
            FinishLeaves(f"{', '.join(sorted(done))} left; every remaining node is leaving too: no re-form", done)
        )
    elif (obs.saving & present) and obs.now - min(obs.told_leave.values()) < obs.save_wait:
        pass  # the members that stay still write the held step
    elif s.complete and s.participants and not s.has_marker:
        actions.append(PokeSurvivors(f"{', '.join(sorted(done))} left: survivors re-form now", done))
    else:
        actions.append(FinishLeaves("survivors are already re-forming", done))
    return actions


def _round(obs: Observation, s: RendezvousState) -> list[SteerAction]:
    """The round being formed: held for nodes restarting after a store restart (or still stopping
    their workers after a poke), completed once every expected node joined; the poke's markers
    dropped once it formed."""
    actions: list[SteerAction] = []
    if not s.complete and _holding(obs):
        missing = obs.awaited - s.participant_addrs
        assert obs.awaited_until is not None  # _holding checked it
        until = min(obs.now + HOLD_STEP, obs.awaited_until)
        if missing and s.participants and (s.deadline is None or s.deadline < min(until, obs.now + HOLD_STEP / 2)):
            actions.append(
                HoldRound(
                    f"round {s.round} held for {', '.join(sorted(missing))} (restarting after the store restart)", until
                )
            )
    if not s.complete:
        expected = expected_members(obs)
        if expected and s.participants and not (expected - obs.noticed):
            # Every node that would train in it is in a notice flow (a whole-fleet wave whose
            # first leaver's exit broke the others' collective, so torchrun restarted them): the
            # steps it would train die with them while their agents upload the held step. Held
            # open, never formed, until they have left (seen lose 21 steps in the storm demo on a
            # loaded box, where the last leavers' uploads took 9 s after the first had gone).
            if s.deadline is None or s.deadline < obs.now + HOLD_STEP / 2:
                leaving = ", ".join(sorted(expected))
                actions.append(
                    HoldRound(f"round {s.round} held: every node in it is leaving ({leaving})", obs.now + HOLD_STEP)
                )
        elif expected and obs.min_nodes <= len(expected) <= obs.max_nodes and expected <= s.participant_addrs:
            actions.append(CompleteRound(f"all {len(expected)} expected nodes joined round {s.round}"))
        elif expected and s.participants and not _holding(obs):
            actions.extend(_hold_for_slow_members(obs, s, expected))
    elif s.has_marker and any(n.local_id < s.round for n in s.wait_list if n.addr == MARKER_ADDR):
        actions.append(DropMarkers(f"round {s.round} formed after the poke"))
    return actions


def _hold_for_slow_members(obs: Observation, s: RendezvousState, expected: frozenset[str]) -> list[SteerAction]:
    """A poke opens the next round at once (RendezvousState.poked), so torch's own last call
    (2 s after the first node joins) would form it without a member still stopping its workers
    (a SIGTERM salvage, a loaded box), and that member's late join would cost a second re-form.
    When each agent left the old round by itself the round stayed closed until the last one was
    out; hold the open round instead, for as long as expected_members waits for a member between
    rounds: max(dead_after, hang_after) after the poke (the marker's heartbeat), then torch decides."""
    poked_at = [t for n, t in s.last_heartbeats.items() if n.is_marker]
    missing = (expected & (obs.members or frozenset())) - s.participant_addrs
    if not poked_at or not missing:
        return []
    until = min(obs.now + HOLD_STEP, min(poked_at) + max(obs.dead_after, obs.hang_after))
    if until <= obs.now or (s.deadline is not None and s.deadline >= min(until, obs.now + HOLD_STEP / 2)):
        return []
    return [HoldRound(f"round {s.round} held for {', '.join(sorted(missing))} (still leaving the last round)", until)]
