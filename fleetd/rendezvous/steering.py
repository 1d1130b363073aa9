"""The steering loop: observe the rendezvous store, ``decide.steer``, apply the actions.

Level-based like the reconcile loop: each pass re-reads torchrun's state and the drain keys, so a
fleetd that was SIGKILLed and restarted simply adopts what it finds (the store lives in the separate
rendezvous host process and training never notices fleetd was gone). The only memory kept between
passes is what the store can re-teach: the last complete round's members, and which leaves are in
flight. Each leaving node's phase (fleetd.protocol.interruption.Phase, read from its keys by
``decide.Observation.phase``) is logged as it moves (``interruption_phase``).

Run it inside fleetd (``Steerer.run``), or standalone for tests and the demo:
``python -m fleetd.rendezvous.steer_main --host H --port P --run-id R``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import cast

from fleetd.rendezvous import decide
from fleetd.rendezvous.client import KEY_COUNT, RendezvousClient, Snapshot
from fleetd.rendezvous.errors import RendezvousError, RendezvousUnavailable
from fleetd.rendezvous.held_step import HeldStepWatch
from fleetd.rendezvous.phase_log import PhaseLog
from fleetd.rendezvous.silence import SilenceWatch
from fleetd.rendezvous.state import RendezvousState
from fleetd.rendezvous.steer_settings import SteerSettings
from fleetd.shared.logs import get_logger
from fleetd.shared.waits import wait_set

log = get_logger(__name__)


@dataclass
class Steerer:
    client: RendezvousClient
    settings: SteerSettings = field(default_factory=SteerSettings)
    members: frozenset[str] | None = None
    members_round: int | None = None
    told_leave: dict[str, datetime] = field(default_factory=dict)
    told_members: set[str] = field(default_factory=set)  # leavers that were members when told
    last_state: RendezvousState | None = None
    adopted: bool = False
    closing: bool = False  # fleetd closed the rendezvous itself (job end): never reopened
    heartbeats: dict[str, datetime] = field(default_factory=dict)
    # Which life of the rendezvous host the store is (rendezvous_keys.HOST_INCARNATION_KEY).
    incarnation: str | None = None
    store_restarts: int = 0
    store_restarted_at: float | None = None  # wall clock when this loop first saw the new store
    awaited: frozenset[str] = frozenset()  # the members before a store restart, until all are back
    awaited_until: datetime | None = None
    # Also tell the node over MQTT (the daemon maps the address to its instance): the store key
    # is enough for fleetd's agents; the command makes the decision visible on the wire.
    on_leave: Callable[[str, str], Awaitable[None]] | None = None
    # Told (address, fleetd's clock in epoch seconds) each time a node's rendezvous heartbeat
    # advances: the store-side liveness signal of the planner's loss rule (fleetd/intake).
    on_heartbeat: Callable[[str, float], None] | None = None
    # The members' last word on the store and through the broker (decide.silent_everywhere).
    silence: SilenceWatch = field(default_factory=SilenceWatch)
    progress_value: bytes | None = None
    progress_at: datetime | None = None
    round_seen_at: datetime | None = None  # a round just formed: its members were all alive then
    tolerated: frozenset[str] = frozenset()
    phase_log: PhaseLog = field(default_factory=PhaseLog)  # leaving nodes' phases, logged as they move
    held: HeldStepWatch = field(default_factory=HeldStepWatch)  # the staying nodes' save (decide.saving)
    # For the stall rule (fleetd/policy/stall.py): when the rendezvous last changed shape (epoch
    # seconds) and whether a round is open now. A job forming a round is not stalled.
    rendezvous_changed_at: float | None = None
    rendezvous_forming: bool = False
    _shape: tuple[object, ...] | None = None
    # The store has no authentication (docs/DESIGN.md, threat model): any host that reaches its
    # port can write keys. With ``known_addr`` (the registry: addresses an agent with a fleet
    # certificate announced over MQTT), an address no fleet node claims has its drain/noticed
    # keys ignored (logged once per address) unless fleetd itself told it to leave.
    known_addr: Callable[[str], bool] | None = None
    ignored_addrs: frozenset[str] = frozenset()
    # The last read of every candidate's drain keys, and the store's key count then (observe).
    _scanned: dict[str, bytes | None] = field(default_factory=dict)
    _key_count: int | None = None
    _scanned_at: datetime | None = None

    async def observe(self, now: datetime) -> decide.Observation:
        from fleetd.protocol import rendezvous_keys as keys

        snap, raw, ready_keys, left_keys, noticed_keys = await self._read(now)
        if await self._store_restarted(raw.get(keys.HOST_INCARNATION_KEY), now):
            return decide.Observation(state=None, now=now, members=self.members)
        pulse = raw.pop(keys.progress_key(self.client.run_id), None)
        if pulse is not None and pulse != self.progress_value:
            # First sight (fleetd just started) counts as progress: a restart must not read a
            # healthy job as hung; a hung one is caught hang_after_s later.
            self.progress_value, self.progress_at = pulse, now
        s = snap.state
        self._note_round(s, now)
        ready = {a for a, k in ready_keys.items() if self.client.parse(keys.DrainReady, k, raw[k]) is not None}
        left = {a for a, k in left_keys.items() if self.client.parse(keys.Left, k, raw[k]) is not None}
        noticed = {a for a, k in noticed_keys.items() if self.client.parse(keys.Noticed, k, raw[k]) is not None}
        self.last_state = s
        self._note_shape(s, now)
        self._note_heartbeats(s, now)
        st = self.settings
        saving = await self.held.unsaved(self.client, self.members or frozenset(), frozenset(self.told_leave))
        if self.awaited and (
            (s is not None and s.complete and self.awaited <= s.participant_addrs)
            or (self.awaited_until is not None and now >= self.awaited_until)
        ):
            self.awaited, self.awaited_until = frozenset(), None  # all back, or given up on
        return decide.Observation(
            state=s,
            now=now,
            members=self.members,
            closing=self.closing,
            drain_ready=frozenset(ready),
            told_leave=dict(self.told_leave),
            left=frozenset(left),
            heartbeats=dict(self.heartbeats),
            min_nodes=st.min_nodes,
            max_nodes=st.max_nodes,
            left_timeout=timedelta(seconds=st.left_timeout_s),
            dead_after=timedelta(seconds=st.dead_after_s),
            awaited=self.awaited,
            awaited_until=self.awaited_until,
            member_leaves=frozenset(self.told_members),
            noticed=frozenset(noticed),
            saving=saving,
            coalesce=timedelta(seconds=st.coalesce_s),
            progress_at=self._progress_at(),
            hang_after=timedelta(seconds=st.hang_after_s),
            **self.silence.observation(self.members),
        )

    async def _read(
        self, now: datetime
    ) -> tuple[Snapshot, dict[str, bytes | None], dict[str, str], dict[str, str], dict[str, str]]:
        """One look at the store: its state and the keys this pass needs (the snapshot, the raw
        values by key, and the drain-ready, left and noticed keys by address)."""
        from fleetd.protocol import rendezvous_keys as keys

        run_id = self.client.run_id
        # Candidates come from the previous pass: a node that appears now is checked next pass.
        candidates = set(self.members or ()) | set(self.told_leave)
        if self.last_state is not None:
            candidates |= self.last_state.participant_addrs | {n.addr for n in self.last_state.waiting}
        candidates -= self._unclaimed(candidates)
        ready_keys = {a: keys.drain_ready_key(run_id, a) for a in candidates}
        left_keys = {a: keys.left_key(run_id, a) for a in self.told_leave}
        # Noticed keys matter only while a leave is in flight (they can hold back its re-form) or a
        # round is forming (one whose every node is leaving is held, not formed: decide._round).
        forming = self.last_state is not None and not self.last_state.complete
        noticed_keys = {a: keys.noticed_key(run_id, a) for a in candidates} if self.told_leave or forming else {}
        # Every candidate's drain keys are one store op each: 1,000-2,000 per pass at 1,000
        # members (bench/steering_load.py: 0.17 s passes). Agents only ever *create* those keys,
        # so they are re-read when the store's key count moved, and every full_scan_s anyway.
        snap, raw = await self.client.observe_with(
            [keys.HOST_INCARNATION_KEY, *left_keys.values(), keys.progress_key(run_id)], key_count=True
        )
        # observe_with keeps the store's key count (an int, not a value) under KEY_COUNT.
        count = cast("int | None", raw.pop(KEY_COUNT, None))
        scan_keys = [*ready_keys.values(), *noticed_keys.values()]
        if (
            count != self._key_count
            or self._scanned_at is None
            or (now - self._scanned_at).total_seconds() >= self.settings.full_scan_s
            or not set(scan_keys) <= set(self._scanned)
        ):
            self._scanned = await self.client.read_keys(scan_keys)
            self._key_count, self._scanned_at = count, now
        raw.update({k: self._scanned.get(k) for k in scan_keys})
        return snap, raw, ready_keys, left_keys, noticed_keys

    def _note_round(self, s: RendezvousState | None, now: datetime) -> None:
        """A complete round seen for the first time is the membership; its first sight is logged."""
        if s is not None and s.complete and s.round != self.members_round:
            # The first sight of a complete round is its membership. Later sights of the same
            # round only shrink while its members exit to re-form; they are still expected.
            self._formed(s)
            self.round_seen_at = now
        if not self.adopted and s is not None:
            self.adopted = True
            log.info(
                "rendezvous_adopted",
                round=s.round,
                complete=s.complete,
                participants=sorted(str(n) for n in s.participants),
                waiting=sorted(str(n) for n in s.waiting),
            )

    def _note_heartbeats(self, s: RendezvousState | None, now: datetime) -> None:
        if s is None:
            return
        for node, beat in s.last_heartbeats.items():
            if not node.is_marker and beat > self.heartbeats.get(node.addr, beat - timedelta(1)):
                self.heartbeats[node.addr] = beat
                self.silence.heartbeat_advanced(node.addr, now)
                if self.on_heartbeat is not None:
                    self.on_heartbeat(node.addr, now.timestamp())

    def _unclaimed(self, candidates: set[str]) -> frozenset[str]:
        if self.known_addr is None:
            return frozenset()
        unknown = frozenset(a for a in candidates if a not in self.told_leave and not self.known_addr(a))
        for addr in sorted(unknown - self.ignored_addrs):
            log.warning(
                "rendezvous_keys_ignored",
                addr=addr,
                why="no node of this fleet announced this address; its store keys are not read",
            )
        self.ignored_addrs = unknown
        return unknown

    async def _store_restarted(self, raw: bytes | None, now: datetime) -> bool:
        """The rendezvous host restarted: its store came back empty. What this loop remembers
        about the old store is wrong now, except who trained: keep the last round's members, so
        the round the restarted torchruns form is completed as soon as all of them are back
        (not by torchrun's last call with whoever came first). Leaves in flight are told again:
        their keys were lost with the store. Returns True when this pass must plan nothing."""
        value = None if raw is None else bytes(raw).decode(errors="replace")
        if value is None:
            return False  # the host writes it first thing; absent only for a moment
        if self.incarnation is None or value == self.incarnation:
            self.incarnation = value
            return False
        self.incarnation = value
        self.store_restarts += 1
        self.store_restarted_at = now.timestamp()
        log.warning(
            "rendezvous_store_restarted",
            restarts=self.store_restarts,
            members=sorted(self.members or ()),
            leaving=sorted(self.told_leave),
            why="the rendezvous host restarted: the store is empty; the nodes write their round back "
            "(agent/supervise/store_ride.py), or restart torchrun if it was down too long",
        )
        self.members_round, self.last_state, self.adopted = None, None, False
        self.heartbeats.clear()
        # Everything else read from the old store is void too, as for a steering that just
        # started: the progress counter starts again (a stale reading must not date the job's
        # last progress, and the new counter's first value must not read as hung), and so do
        # the round's sighting and the tolerated set.
        self.progress_value = self.progress_at = self.round_seen_at = None
        self.tolerated, self._shape = frozenset(), None
        if self.members:
            self.awaited = frozenset(self.members)
            self.awaited_until = now + timedelta(seconds=self.settings.restart_hold_s)
        for addr in list(self.told_leave):
            await self.client.tell_leave(addr, "told again: the rendezvous store restarted")
            self.told_leave[addr] = now
        return True

    def _note_shape(self, s: RendezvousState | None, now: datetime) -> None:
        if s is None:
            self.rendezvous_forming = False
            return
        shape = (s.round, s.complete, s.closed, frozenset(s.participant_addrs), frozenset(n.addr for n in s.waiting))
        if shape != self._shape:
            self._shape, self.rendezvous_changed_at = shape, now.timestamp()
        self.rendezvous_forming = not s.closed and (not s.complete or bool(s.waiting))

    def _progress_at(self) -> datetime | None:
        """When the job last showed it was alive: its progress counter moved, or a round formed
        (before the first step of a round, under load, torchrun's heartbeats can lag for seconds
        while nothing is hung yet). A trainer that never bumps the counter gets hang_after_s of
        grace after each round forms, then decide's old rule (a stale heartbeat decides)."""
        seen = [t for t in (self.progress_at, self.round_seen_at) if t is not None]
        return max(seen) if seen else None

    async def step(self) -> tuple[decide.SteerAction, ...]:
        now = datetime.now(UTC)
        obs = await self.observe(now)
        self.phase_log.note(obs)
        actions = decide.steer(obs)
        if obs.silent_after is not None:
            self.silence.note_margin(obs, decide.silent_everywhere(obs))
        tolerated: frozenset[str] = frozenset()
        for action in actions:
            if isinstance(action, decide.TolerateStale):
                tolerated = action.addrs
                if tolerated != self.tolerated:  # once per change, not every 50 ms pass
                    log.info("rendezvous_steer", action="TolerateStale", reason=action.reason)
                continue
            await self.apply(action, obs)
        if self.tolerated and not tolerated:
            log.info("rendezvous_stale_cleared", addrs=sorted(self.tolerated))
        self.tolerated = tolerated
        return actions

    async def apply(self, action: decide.SteerAction, obs: decide.Observation) -> None:
        st = self.settings
        log.info("rendezvous_steer", action=type(action).__name__, reason=action.reason)
        match action:
            case decide.RemoveNodes(addrs=addrs):
                await self.client.update(lambda s: s.without_addrs(addrs, st.min_nodes))
                if self.members is not None:
                    self.members = self.members - addrs
            case decide.DropSuperseded(nodes=nodes):
                await self.client.update(lambda s: s.without_nodes(nodes, st.min_nodes))
            case decide.TellLeave(addr=addr):
                await self.client.tell_leave(addr, action.reason)
                self.told_leave[addr] = obs.now
                if obs.members is None or addr in obs.members:
                    self.told_members.add(addr)
                if self.on_leave is not None:
                    try:
                        await self.on_leave(addr, action.reason)
                    except Exception as exc:  # noqa: BLE001 - MQTT trouble must not stop steering
                        log.warning("leave_command_failed", addr=addr, error=str(exc))
            case decide.PokeSurvivors(finished=done):
                # The next round opened in the same write as the marker (RendezvousState.poked).
                await self.client.update(
                    lambda s: s.poked(datetime.now(UTC)) if s.complete and not s.has_marker else None
                )
                await self._forget(done)
            case decide.FinishLeaves(finished=done):
                await self._forget(done)
            case decide.CompleteRound():
                expected = decide.expected_members(obs) or frozenset()

                def complete(s: RendezvousState) -> RendezvousState | None:
                    # Re-check on the fresh copy the CAS loop read: a node may have left meanwhile.
                    if s.complete or s.closed or not expected <= s.participant_addrs:
                        return None
                    return s.completed().without_markers()

                formed = await self.client.update(complete)
                if formed is not None:
                    self._formed(formed)
                    log.info("rendezvous_round_completed", round=formed.round, ranks=formed.ranks_by_addr())
            case decide.HoldRound(until=until):
                await self.client.update(
                    lambda s: (
                        replace(s, deadline=until)
                        if not s.complete and (s.deadline is None or s.deadline < until)
                        else None
                    )
                )
            case decide.Reopen():
                await self.client.update(lambda s: replace(s, closed=False) if s.closed else None)
            case decide.DropMarkers():
                await self.client.update(lambda s: s.without_markers() if s.has_marker else None)

    def _formed(self, s: RendezvousState) -> None:
        """A newly formed round is the membership; a leaver outside it needs no poke when it exits
        (a storm's replacements formed without the noticed nodes: a poke re-formed them again)."""
        self.members, self.members_round = s.participant_addrs, s.round
        self.told_members &= s.participant_addrs

    async def _forget(self, done: frozenset[str]) -> None:
        for addr in done:
            self.told_leave.pop(addr, None)
            self.told_members.discard(addr)
            await self.client.forget_node(addr)

    async def reform(self, reason: str) -> bool:
        """Stall recovery: poke every torchrun of the formed round into a new one (the same
        marker a leave uses; workers save their completed step on the way out). False when there
        is no formed round to poke."""
        log.warning("rendezvous_reform", reason=reason)
        done = await self.client.update(
            lambda s: s.poked(datetime.now(UTC)) if s.complete and not s.has_marker else None
        )
        return done is not None

    async def close_rendezvous(self) -> None:
        """Job end: no node may join again; torchruns exit when their workers finish."""
        self.closing = True  # and the steering does not reopen it (decide.Reopen)
        await self.client.update(lambda s: None if s.closed else s.closed_for_good())

    async def reopen_rendezvous(self) -> None:
        """A stopped job resumes (a team's pause ended): nodes may join again."""
        self.closing = False
        await self.client.update(lambda s: replace(s, closed=False) if s.closed else None)

    async def run(self, stop: asyncio.Event) -> None:
        """Steer until ``stop``. A store outage (the rendezvous host restarting) is ridden through
        quietly: one line when it begins, one when the store answers again; meanwhile a plain TCP
        probe every ``OUTAGE_PROBE_S``, then one reconnect (RendezvousClient). The next pass sees the new
        incarnation and re-seeds what the store lost (_store_restarted)."""
        down_since: float | None = None
        while not stop.is_set():
            try:
                await self.step()
                if down_since is not None:
                    log.warning("rendezvous_reachable_again", down_s=round(time.monotonic() - down_since, 1))
                    down_since = None
            except RendezvousUnavailable as exc:
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning(
                        "rendezvous_unreachable",
                        error=str(exc).splitlines()[0][:200],
                        why="steering waits for the store; training does not need it meanwhile",
                    )
                await self.client.reconnect_when_answering(stop, OUTAGE_PROBE_S)
                continue
            except RendezvousError as exc:
                log.error("rendezvous_steer_failed", error=str(exc).splitlines()[0][:300])
            await wait_set(stop, self.settings.interval_s)


OUTAGE_PROBE_S = 0.5
