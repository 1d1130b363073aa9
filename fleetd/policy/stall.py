"""Stalled-job detection and the recovery ladder: a pure fold over what fleetd sees each tick.

A job is stalled when no step completed for ``stall_after_s`` while nodes are billed (the planner
counts nodes, not steps, so nothing else would notice). fleetd/stall_watch.py feeds :func:`assess`
plain data and ``now`` and carries out what it returns: wait while the store is down or a round
forms, else one rung per ``escalate_after_s`` by cause (docs/DESIGN.md "Failure model").
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum


class StallCause(StrEnum):
    STORE_UNREACHABLE = "rendezvous store unreachable"
    STORE_RESTARTED = "rendezvous store restarted; nodes reattaching"
    TRAINERS_EXITED = "trainers exited"
    AGENTS_SILENT = "no telemetry from the nodes"
    RANKS_HUNG = "all ranks hung"
    REFORMING = "rendezvous re-forming"


class Recovery(StrEnum):
    RESTART_TRAINERS = "restart trainers"
    REFORM = "re-form"
    REPLACE_NODES = "replace nodes"


LADDERS: dict[StallCause, tuple[Recovery, ...]] = {
    StallCause.TRAINERS_EXITED: (Recovery.RESTART_TRAINERS, Recovery.REFORM, Recovery.REPLACE_NODES),
    StallCause.RANKS_HUNG: (Recovery.REFORM, Recovery.RESTART_TRAINERS, Recovery.REPLACE_NODES),
    StallCause.AGENTS_SILENT: (Recovery.REFORM, Recovery.RESTART_TRAINERS, Recovery.REPLACE_NODES),
}
WAITING = frozenset({StallCause.STORE_UNREACHABLE, StallCause.STORE_RESTARTED, StallCause.REFORMING})


@dataclass(frozen=True, slots=True)
class StallSettings:
    stall_after_s: float = 180.0
    escalate_after_s: float = 120.0
    replace_nodes: bool = True
    telemetry_fresh_s: float = 30.0
    reforming_max_s: float = 600.0
    max_history: int = 50


@dataclass(frozen=True, slots=True)
class NodeProgress:
    instance_id: str
    billed: bool  # EC2 runs it and it is not on its way out
    trainer_running: bool | None  # the agent's status says "training" (None: no status yet)
    step: int | None = None
    telemetry_at: float | None = None


@dataclass(frozen=True, slots=True)
class StallObservation:
    now: float
    nodes: tuple[NodeProgress, ...]
    store_reachable: bool | None = None  # None: not known (no steering in this process)
    store_restarted_at: float | None = None  # the last time fleetd saw a new store
    training_expected: bool = True  # False once the job is being stopped
    # From fleetd's steering (None/False: not known): when the rendezvous last changed shape (a
    # round opened, nodes joined or left it, a round formed), and whether a round is open now.
    rendezvous_changed_at: float | None = None
    rendezvous_forming: bool = False


@dataclass(frozen=True, slots=True)
class Episode:
    since: float  # the last step before the stall
    detected_at: float
    cause: StallCause
    billed_nodes: int
    node_seconds: float  # billed node-time without a step, from ``since``
    accounted_to: float
    actions: tuple[tuple[Recovery, float], ...] = ()
    ended_at: float | None = None  # the first step after it

    @property
    def duration_s(self) -> float | None:
        return None if self.ended_at is None else self.ended_at - self.since

    @property
    def recovery_s(self) -> float | None:
        """Detection to the first step again."""
        return None if self.ended_at is None else self.ended_at - self.detected_at


@dataclass(frozen=True, slots=True)
class StallTracker:
    best_step: int | None = None
    advanced_at: float | None = None  # the last tick any node's step moved
    steps: tuple[tuple[str, int], ...] = ()  # each node's step at the last tick
    episode: Episode | None = None
    history: tuple[Episode, ...] = ()

    @property
    def stalled_node_seconds(self) -> float:
        open_ = self.episode.node_seconds if self.episode is not None else 0.0
        return open_ + sum(e.node_seconds for e in self.history)


@dataclass(frozen=True, slots=True)
class RecoveryAction:
    kind: Recovery
    instance_ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class StallDecision:
    tracker: StallTracker
    stalled: bool
    cause: StallCause | None = None
    detected: bool = False  # this tick found the stall (one log line)
    cause_changed: bool = False
    ended: Episode | None = None  # this tick saw the first step after a stall
    actions: tuple[RecoveryAction, ...] = ()
    notes: tuple[str, ...] = field(default=())


# First match wins. Store down or just restarted: wait; systemd restarts it and the agents start
# torchrun again once it answers (agent/supervise/store_watch.py), so new nodes would not help.
def _cause(obs: StallObservation, since: float, s: StallSettings) -> StallCause:
    if obs.store_reachable is False:
        return StallCause.STORE_UNREACHABLE
    r = obs.store_restarted_at
    if r is not None and r >= since and obs.now - r < s.escalate_after_s:
        return StallCause.STORE_RESTARTED
    if _reforming(obs, since, s):
        return StallCause.REFORMING
    billed = [n for n in obs.nodes if n.billed]
    reporting = [n for n in billed if n.trainer_running is not None]
    if reporting and not any(n.trainer_running for n in reporting):
        return StallCause.TRAINERS_EXITED
    if not any(n.telemetry_at is not None and obs.now - n.telemetry_at <= s.telemetry_fresh_s for n in billed):
        return StallCause.AGENTS_SILENT
    return StallCause.RANKS_HUNG


# On an overloaded machine a re-form takes a while (every worker restarts and imports torch);
# read as "all ranks hung", its recovery (poke, restart, replace) only forced more re-forms.
def _reforming(obs: StallObservation, since: float, s: StallSettings) -> bool:
    """Forming a round (or it just changed), and not for too long without a step."""
    if obs.now - since > s.reforming_max_s:
        return False
    changed = obs.rendezvous_changed_at
    return obs.rendezvous_forming or (changed is not None and obs.now - changed <= s.stall_after_s)


def _next_action(ep: Episode, obs: StallObservation, s: StallSettings) -> RecoveryAction | None:
    if ep.cause in WAITING:
        return None
    last = ep.actions[-1][1] if ep.actions else None
    if last is not None and obs.now - last < s.escalate_after_s:
        return None
    done = {kind for kind, _ in ep.actions}
    billed = [n for n in obs.nodes if n.billed]
    for kind in LADDERS[ep.cause]:
        if kind in done:
            continue
        if kind is Recovery.REPLACE_NODES and not s.replace_nodes:
            continue
        if kind is Recovery.RESTART_TRAINERS:
            stopped = tuple(n.instance_id for n in billed if n.trainer_running is False)
            ids = stopped or tuple(n.instance_id for n in billed)
        elif kind is Recovery.REPLACE_NODES:
            ids = tuple(n.instance_id for n in billed)
        else:
            ids = ()
        idle = obs.now - ep.since
        return RecoveryAction(
            kind, ids, f"no step for {idle:.0f} s with {len(billed)} node(s) billed ({ep.cause}): {kind}"
        )
    return None


def assess(tracker: StallTracker, obs: StallObservation, settings: StallSettings) -> StallDecision:
    """One tick: fold the newest step in, detect or end a stall, pick the next recovery rung."""
    s = settings
    now_steps = tuple(sorted((n.instance_id, n.step) for n in obs.nodes if n.step is not None))
    before = dict(tracker.steps)
    # Progress is any node's step moving, not a new maximum: a job that rolled back to an older
    # checkpoint is training again even while it re-does steps.
    moved = any(before.get(iid) != step for iid, step in now_steps)
    newest = max((step for _, step in now_steps), default=None)
    t = replace(tracker, steps=now_steps)
    if newest is not None and (t.best_step is None or newest > t.best_step):
        t = replace(t, best_step=newest)
    if moved:
        t = replace(t, advanced_at=obs.now)
        if t.episode is not None:
            ended = _accrue(t.episode, obs)
            ended = replace(ended, ended_at=obs.now)
            t = replace(t, episode=None, history=(*t.history, ended)[-s.max_history :])
            return StallDecision(t, False, ended.cause, ended=ended)
        return StallDecision(t, False)

    billed = sum(1 for n in obs.nodes if n.billed)
    if t.episode is not None:
        ep = _accrue(t.episode, obs)
        if billed == 0 or not obs.training_expected:
            # Nothing billed (or the job is being stopped): the stall ends without a step.
            t = replace(
                t,
                episode=None,
                history=(*t.history, replace(ep, ended_at=obs.now))[-s.max_history :],
                advanced_at=obs.now,
            )
            return StallDecision(t, False, ep.cause, notes=("stall over: no node billed or the job stops",))
        cause = _cause(obs, ep.since, s)
        changed = cause is not ep.cause
        ep = replace(ep, cause=cause, billed_nodes=billed)
        action = _next_action(ep, obs, s)
        if action is not None:
            ep = replace(ep, actions=(*ep.actions, (action.kind, obs.now)))
        t = replace(t, episode=ep)
        return StallDecision(t, True, cause, cause_changed=changed, actions=(action,) if action else ())

    if t.advanced_at is None or billed == 0 or not obs.training_expected:
        return StallDecision(t, False)  # never trained yet (boot_timeout_s covers that), or nothing billed
    idle = obs.now - t.advanced_at
    if idle <= s.stall_after_s or _reforming(obs, t.advanced_at, s):
        return StallDecision(t, False)
    cause = _cause(obs, t.advanced_at, s)
    ep = Episode(
        since=t.advanced_at,
        detected_at=obs.now,
        cause=cause,
        billed_nodes=billed,
        node_seconds=idle * billed,
        accounted_to=obs.now,
    )
    action = _next_action(ep, obs, s)
    if action is not None:
        ep = replace(ep, actions=((action.kind, obs.now),))
    t = replace(t, episode=ep)
    return StallDecision(t, True, cause, detected=True, actions=(action,) if action else ())


def _accrue(ep: Episode, obs: StallObservation) -> Episode:
    billed = sum(1 for n in obs.nodes if n.billed)
    dt = max(0.0, obs.now - ep.accounted_to)
    return replace(ep, node_seconds=ep.node_seconds + dt * billed, accounted_to=obs.now)
