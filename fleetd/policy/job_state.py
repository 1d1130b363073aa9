"""The job's lifecycle: a pure fold from what the nodes report to the job's state.

    PENDING ─► STARTING ─► RUNNING ◄──► RECOVERING
        │          │          │              │
        └──────────┴──────────┴──────────────┴─► SUCCEEDED | FAILED | CANCELLED (terminal)

Success, the user's failure against the cloud's, restarts, and how a terminal job releases its
nodes: docs/DESIGN.md "Job lifecycle". No I/O: ``now`` is passed in; fleetd/job_watch.py feeds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

from fleetd.policy.observation import DesiredJob


class JobState(StrEnum):
    PENDING = "pending"  # no node has trained yet
    STARTING = "starting"  # nodes are billed; the first step has not come yet
    RUNNING = "running"
    RECOVERING = "recovering"  # it trained, and no trainer runs now (a re-form, a restart)
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


class ExitClass(StrEnum):
    SUCCESS = "success"
    USER_FAILURE = "user-failure"
    INFRASTRUCTURE = "infrastructure"


@dataclass(frozen=True, slots=True)
class JobSettings:
    max_restarts: int = 3  # user-code failures fleetd restarts before the job FAILS
    settle_s: float = 10.0  # exits this close together are one event
    # A lost peer makes the survivors' collectives fail: their exits are the cloud's, not the user's.
    explained_window_s: float = 60.0  # a notice/loss/store restart this recent explains a failure
    release_after_s: float = 30.0  # a finished job's nodes go at the latest this long after it ended
    # False for folder mode: the job's code reports no step, so a running trainer is the only
    # sign that it trains (else the job would stay STARTING for its whole life).
    reports_steps: bool = True


@dataclass(frozen=True, slots=True)
class NodeExit:
    """One ``trainer-exited`` report (agent/supervise: finished, failed, stopped, store-lost,
    rendezvous-failed, lost)."""

    instance_id: str
    at: float
    reason: str
    exit_code: int | None = None


@dataclass(frozen=True, slots=True)
class JobNode:
    instance_id: str
    billed: bool
    training: bool  # the agent reports its trainer running
    noticed_at: float | None = None  # a spot notice (any source)
    leaving: bool = False  # fleetd drained it, or it is being terminated
    lost_at: float | None = None  # declared lost, or gone from EC2 without fleetd ending it


@dataclass(frozen=True, slots=True)
class JobObservation:
    now: float
    nodes: tuple[JobNode, ...] = ()
    exits: tuple[NodeExit, ...] = ()  # every exit seen so far (the fold skips those it counted)
    best_step: int | None = None  # the highest step any node or durable checkpoint reached
    durable_step: int | None = None
    total_steps: int | None = None
    cancel_requested: str | None = None  # the operator's reason, when asked
    store_restarted_at: float | None = None


@dataclass(frozen=True, slots=True)
class JobRecord:
    """The job's state and the memory the fold needs (persisted by the watcher as job.json)."""

    state: JobState = JobState.PENDING
    since: float | None = None
    reason: str = ""
    restarts: int = 0  # user-code failures restarted so far
    last_failure_at: float | None = None
    failure_nodes: frozenset[str] = field(default_factory=frozenset)  # the nodes of that failure
    success_at: float | None = None  # a node reported its trainer finished (settling)
    ended_at: float | None = None
    final_step: int | None = None
    counted: frozenset[tuple[str, float]] = field(default_factory=frozenset)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


@dataclass(frozen=True, slots=True)
class JobDecision:
    record: JobRecord
    # Nodes whose trainers to start again: a retried user failure, or a failure the cloud
    # explains (the agent waits for fleetd's word after any failed exit).
    restart: tuple[str, ...] = ()
    changed: bool = False  # the state changed this tick (log it, persist it)


def classify_exit(ex: NodeExit, obs: JobObservation, s: JobSettings) -> ExitClass:
    """Whose fault one trainer exit was (module docstring)."""
    if ex.reason == "finished" and ex.exit_code in (0, None):
        return ExitClass.SUCCESS
    if ex.reason in ("stopped", "store-lost", "rendezvous-failed"):
        return ExitClass.INFRASTRUCTURE
    node = next((n for n in obs.nodes if n.instance_id == ex.instance_id), None)
    if node is not None and (node.noticed_at is not None or node.leaving or node.lost_at is not None):
        return ExitClass.INFRASTRUCTURE
    since = ex.at - s.explained_window_s
    recent = [obs.store_restarted_at] + [t for n in obs.nodes for t in (n.noticed_at, n.lost_at)]
    if any(t is not None and since <= t <= ex.at + s.settle_s for t in recent):
        return ExitClass.INFRASTRUCTURE
    return ExitClass.USER_FAILURE


def _staying(instance_id: str, obs: JobObservation) -> bool:
    node = next((n for n in obs.nodes if n.instance_id == instance_id), None)
    return node is not None and node.billed and node.noticed_at is None and not node.leaving and node.lost_at is None


def _end(rec: JobRecord, state: JobState, now: float, reason: str, step: int | None) -> JobRecord:
    return replace(rec, state=state, since=now, ended_at=now, reason=reason, final_step=step)


def advance(rec: JobRecord, obs: JobObservation, s: JobSettings) -> JobDecision:
    """One tick of the lifecycle."""
    if rec.terminal:
        return JobDecision(rec)
    now = obs.now
    before = rec.state
    if obs.cancel_requested is not None:
        rec = _end(rec, JobState.CANCELLED, now, f"cancelled: {obs.cancel_requested}", obs.best_step)
        return JobDecision(rec, changed=True)
    if obs.total_steps is not None and obs.best_step is not None and obs.best_step >= obs.total_steps:
        rec = _end(rec, JobState.SUCCEEDED, now, f"reached total_steps {obs.total_steps}", obs.best_step)
        return JobDecision(rec, changed=True)

    restart: list[str] = []
    for ex in sorted((e for e in obs.exits if (e.instance_id, e.at) not in rec.counted), key=lambda e: e.at):
        rec = replace(rec, counted=rec.counted | {(ex.instance_id, ex.at)})
        kind = classify_exit(ex, obs, s)
        if kind is ExitClass.SUCCESS:
            rec = replace(rec, success_at=rec.success_at if rec.success_at is not None else ex.at)
        elif kind is ExitClass.USER_FAILURE:
            rec = replace(rec, success_at=None)  # a rank failed: the job did not finish well
            # One failure: other nodes' exits within settle_s of it (every rank hits the same bug).
            # A node failing again after its restart is a new one, however soon.
            same = (
                rec.last_failure_at is not None
                and ex.at - rec.last_failure_at <= s.settle_s
                and ex.instance_id not in rec.failure_nodes
            )
            why = (
                f"the job's setup failed on {ex.instance_id}: {ex.reason.removeprefix('setup-failed: ')}"
                if ex.reason.startswith("setup-failed")
                else f"the job's code exited with {ex.exit_code} on {ex.instance_id}"
            )
            if not same:
                if rec.restarts >= s.max_restarts:
                    rec = _end(rec, JobState.FAILED, now, f"{why}; {rec.restarts} restarts used", obs.best_step)
                    return JobDecision(rec, changed=True)
                rec = replace(rec, restarts=rec.restarts + 1, reason=f"{why}; restart {rec.restarts + 1}")
            nodes = rec.failure_nodes | {ex.instance_id} if same else frozenset({ex.instance_id})
            rec = replace(rec, last_failure_at=ex.at, failure_nodes=nodes)
            restart.append(ex.instance_id)
        elif ex.reason in ("failed", "lost") and _staying(ex.instance_id, obs):
            # The cloud's fault on a node that stays (a peer was lost, the store restarted): the
            # agent waits for fleetd's word, which costs the job nothing. A node that is noticed,
            # leaving or lost is on its way out: its exit is the drain's, never restarted.
            restart.append(ex.instance_id)

    training = any(n.billed and n.training for n in obs.nodes)
    if rec.success_at is not None and (not training or now - rec.success_at >= s.settle_s):
        rec = _end(rec, JobState.SUCCEEDED, now, "the run command exited 0", obs.best_step)
        return JobDecision(rec, changed=True)
    if training and (obs.best_step is not None or not s.reports_steps):
        state = JobState.RUNNING
    elif rec.state in (JobState.RUNNING, JobState.RECOVERING):
        state = JobState.RECOVERING
    elif any(n.billed for n in obs.nodes):
        state = JobState.STARTING
    else:
        state = JobState.PENDING
    if state is not before:
        rec = replace(rec, state=state, since=now)
    return JobDecision(rec, restart=tuple(dict.fromkeys(restart)), changed=state is not before)


def desired_job(rec: JobRecord, durable_step: int | None, now: float, s: JobSettings) -> DesiredJob:
    """What the planner should do with the fleet."""
    if rec.state is JobState.CANCELLED:
        return DesiredJob.STOP  # coordinated checkpoint, then stop every node
    if rec.state not in TERMINAL:
        return DesiredJob.RUN
    if rec.state is JobState.FAILED:
        return DesiredJob.END  # the last good checkpoint is the one kept; nothing more will come
    saved = rec.final_step is None or (durable_step is not None and durable_step >= rec.final_step)
    waited = rec.ended_at is None or now - rec.ended_at >= s.release_after_s
    return DesiredJob.END if saved or waited else DesiredJob.RUN
