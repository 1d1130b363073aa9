"""The node registry: what the intakes have learned about each node, merged and de-duplicated.

Both intakes call ``apply(event)``; the reconcile loop reads ``record(id)`` / ``records()`` or folds
the facts into the planner's ``Node`` with ``observe(node)``. Urgent events wake the loop through
``wake``; telemetry does not. A repeated ``dedup_key`` (QoS 1 redelivery, SQS at-least-once) is
counted and ignored; the same fact from two sources is kept as two signals. Everything runs on the
event loop, so nothing is locked. (docs/DESIGN.md "Partitions: signals from independent sources")
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fleetd.intake.events import (
    URGENT,
    AgentStatus,
    AgentTelemetry,
    InstanceStateChanged,
    IntakeEvent,
    InterruptionNotice,
    RebalanceRecommended,
    TrainingEvent,
)
from fleetd.policy.model import Node, node_with
from fleetd.protocol.messages import Status, Telemetry, TrainerExited
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

# Weight of a new telemetry sample in the moving averages (about ten reports' memory).
UTIL_SMOOTHING = 0.1
# Telemetry older than this no longer describes the node: its rates are not folded into the
# planner's Node (a node cut from the broker must not be judged a straggler on its last report).
TELEMETRY_FRESH_S = 10.0

# Higher = further along toward gone; merging EC2's view with events keeps the furthest.
_EC2_STATE_RANK = {"pending": 0, "running": 1, "stopping": 2, "stopped": 3, "shutting-down": 4, "terminated": 5}


@dataclass(frozen=True, slots=True)
class NodeRecord:
    instance_id: str
    tracked: bool = False  # launched by this fleet (the controller said so via track())
    status: Status | None = None
    status_at: float | None = None
    last_seen_at: float | None = None  # any message from the agent except "offline"
    agent_offline_at: float | None = None  # last will or clean goodbye
    store_seen_at: float | None = None  # its rendezvous heartbeat last advanced (steering saw it)
    telemetry: Telemetry | None = None
    telemetry_at: float | None = None
    # Moving averages over the ~1 Hz reports: one sample must not decide a scale-down.
    gpu_util_avg: float | None = None
    cpu_avg: float | None = None
    steps_avg: float | None = None  # nor one slow report a straggler's replacement
    notice_at: float | None = None  # first time any source reported the interruption
    notice_deadline: float | None = None
    notice_action: str | None = None
    notice_sources: frozenset[str] = frozenset()
    rebalance_at: float | None = None
    rebalance_sources: frozenset[str] = frozenset()
    ec2_state: str | None = None
    ec2_state_at: float | None = None
    last_event: IntakeEvent | None = None  # the last non-telemetry event
    # The latest time the agent said its trainer is gone: TrainerExited (its reason says why),
    # or status "leaving" (the drain flow finished). The planner reads it as "left" only when
    # it comes after the node's drain or notice (Node.has_left): an earlier exit is a crash.
    left_at: float | None = None
    exit_reason: str = ""
    exit_at: float | None = None  # when that TrainerExited arrived (the job watcher counts each once)
    exit_code: int | None = None


@dataclass
class RegistryStats:
    applied: int = 0
    duplicates: int = 0
    by_type: dict[str, int] = field(default_factory=dict)


class NodeRegistry:
    def __init__(
        self,
        *,
        wake: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
        dedup_capacity: int = 100_000,
        training_event_capacity: int = 10_000,
    ) -> None:
        self._wake = wake or (lambda: None)
        self.clock = clock
        self._nodes: dict[str, NodeRecord] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._dedup_capacity = dedup_capacity
        # checkpoint-saved/-uploaded and trainer-exited, in arrival order, for the reconcile loop.
        self._training: deque[TrainingEvent] = deque(maxlen=training_event_capacity)
        # Node address (agent status node_addr) -> instance: the steering knows nodes by address.
        self._by_addr: dict[str, str] = {}
        self.stats = RegistryStats()
        # Notices applied so far (no duplicates): the loop's urgent pass runs only when it moved.
        self.notices_seen = 0

    # ------------------------------------------------------------------ membership
    def track(self, instance_id: str) -> None:
        """This fleet launched ``instance_id`` (EventBridge events for it are ours)."""
        rec = self._nodes.get(instance_id)
        if rec is None:
            self._nodes[instance_id] = NodeRecord(instance_id, tracked=True)
        elif not rec.tracked:  # every pass tracks every node: a copy only when it changes
            self._nodes[instance_id] = _fast_replace(rec, tracked=True)

    def forget(self, instance_id: str) -> None:
        rec = self._nodes.pop(instance_id, None)
        if rec is not None and rec.status is not None and self._by_addr.get(rec.status.node_addr) == instance_id:
            del self._by_addr[rec.status.node_addr]

    def note_store_heartbeat(self, addr: str, at: float) -> None:
        """The steering saw ``addr``'s torchrun keep-alive advance at ``at`` (fleetd's clock): the
        store-side sign of life the loss rule weighs against broker silence. An address no agent
        has named yet is ignored (the next heartbeat, 2 s later, finds it)."""
        iid = self._by_addr.get(addr)
        rec = self._nodes.get(iid) if iid is not None else None
        if rec is not None and iid is not None:
            self._nodes[iid] = dataclasses.replace(rec, store_seen_at=_latest(rec.store_seen_at, at))

    def broker_seen_at(self, addr: str) -> float | None:
        """When the agent at ``addr`` last spoke through the broker (fleetd's clock), if known."""
        iid = self._by_addr.get(addr)
        rec = self._nodes.get(iid) if iid is not None else None
        return None if rec is None else rec.last_seen_at

    def knows_addr(self, addr: str) -> bool:
        """Some node of this fleet announced ``addr`` as its address (its status over MQTT, which
        the broker accepts only under the node's own certificate name)."""
        return addr in self._by_addr

    def is_known(self, instance_id: str) -> bool:
        """Tracked, or has spoken on this fleet's topics."""
        return instance_id in self._nodes

    def record(self, instance_id: str) -> NodeRecord | None:
        return self._nodes.get(instance_id)

    def records(self) -> tuple[NodeRecord, ...]:
        return tuple(self._nodes.values())

    def drain_training_events(self) -> list[TrainingEvent]:
        out = list(self._training)
        self._training.clear()
        return out

    # ------------------------------------------------------------------ intake
    def apply(self, event: IntakeEvent) -> bool:
        """Merge one event; False if it was a duplicate delivery (nothing changed)."""
        # A repeat is a redelivery (QoS 1, SQS at least once). The IMDS notice via MQTT and the
        # EventBridge warning carry different keys: two independent signals, both kept.
        if not isinstance(event, AgentTelemetry) and event.dedup_key:
            if event.dedup_key in self._seen:
                self.stats.duplicates += 1
                log.debug("intake_duplicate", instance_id=event.instance_id, key=event.dedup_key)
                return False
            self._seen[event.dedup_key] = None
            if len(self._seen) > self._dedup_capacity:
                self._seen.popitem(last=False)
        at = event.received_at or self.clock()
        rec = self._nodes.get(event.instance_id) or NodeRecord(event.instance_id)
        self._nodes[event.instance_id] = _merge(rec, event, at)
        if isinstance(event, AgentStatus) and event.status.node_addr:
            self._by_addr[event.status.node_addr] = event.instance_id
        self.stats.applied += 1
        name = type(event).__name__
        self.stats.by_type[name] = self.stats.by_type.get(name, 0) + 1
        if isinstance(event, InterruptionNotice):
            self.notices_seen += 1
        if isinstance(event, TrainingEvent):
            self._training.append(event)
        if isinstance(event, URGENT):
            self._wake()
        return True

    def apply_all(self, events: Iterable[IntakeEvent]) -> int:
        return sum(self.apply(e) for e in events)

    # ------------------------------------------------------------------ for the planner
    def observe(self, node: Node) -> Node:
        """``node`` (from EC2 and the state DB) with what the intakes learned folded in."""
        rec = self._nodes.get(node.instance_id)
        if rec is None:
            return node
        tele = rec.telemetry
        fresh = (
            tele is not None and rec.telemetry_at is not None and self.clock() - rec.telemetry_at <= TELEMETRY_FRESH_S
        )
        ec2_state = node.ec2_state
        if rec.ec2_state is not None and _EC2_STATE_RANK.get(rec.ec2_state, 0) > _EC2_STATE_RANK.get(ec2_state, 0):
            ec2_state = rec.ec2_state  # the event is news DescribeInstances may not show yet
        return node_with(
            node,
            ec2_state=ec2_state,
            last_seen_at=_latest(node.last_seen_at, rec.last_seen_at),
            agent_offline_at=_latest(node.agent_offline_at, rec.agent_offline_at),
            store_seen_at=_latest(node.store_seen_at, rec.store_seen_at),
            notice_at=node.notice_at if node.notice_at is not None else rec.notice_at,
            notice_deadline=node.notice_deadline if node.notice_deadline is not None else rec.notice_deadline,
            rebalance_at=node.rebalance_at if node.rebalance_at is not None else rec.rebalance_at,
            left_at=_latest(node.left_at, rec.left_at),
            gpu_util_pct=(rec.gpu_util_avg if rec.gpu_util_avg is not None else tele.gpu_util_pct)
            if fresh and tele is not None
            else node.gpu_util_pct,
            cpu_pct=rec.cpu_avg if fresh and rec.cpu_avg is not None else node.cpu_pct,
            steps_per_s=tele.steps_per_s
            if fresh and tele is not None and tele.steps_per_s is not None
            else node.steps_per_s,
            steps_per_s_avg=rec.steps_avg if fresh and rec.steps_avg is not None else node.steps_per_s_avg,
            step=tele.step if tele is not None and tele.step is not None else node.step,
            code_digest=rec.status.code_digest if rec.status is not None else node.code_digest,
        )


def _smooth(avg: float | None, sample: float | None) -> float | None:
    if sample is None:
        return avg
    return sample if avg is None else (1 - UTIL_SMOOTHING) * avg + UTIL_SMOOTHING * sample


def _latest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(NodeRecord))


def _fast_replace(rec: NodeRecord, **changes: object) -> NodeRecord:
    """dataclasses.replace for the hot path (telemetry: ~1 per node per second, 2,000/s at
    2,000 agents): the same fields copied without replace's per-call introspection (60 -> 10 us)."""
    new = object.__new__(NodeRecord)
    for name in _RECORD_FIELDS:
        object.__setattr__(new, name, changes[name] if name in changes else getattr(rec, name))
    return new


def _merge(rec: NodeRecord, event: IntakeEvent, at: float) -> NodeRecord:
    replace = dataclasses.replace
    if isinstance(event, AgentTelemetry):
        tel = event.telemetry
        return _fast_replace(
            rec,
            telemetry=tel,
            telemetry_at=at,
            last_seen_at=at,
            gpu_util_avg=_smooth(rec.gpu_util_avg, tel.gpu_util_pct),
            cpu_avg=_smooth(rec.cpu_avg, tel.cpu_pct),
            steps_avg=_smooth(rec.steps_avg, tel.steps_per_s),
        )
    if isinstance(event, AgentStatus):
        if event.status.state == "offline":
            return replace(rec, status=event.status, status_at=at, agent_offline_at=at, last_event=event)
        left_at = _latest(rec.left_at, at) if event.status.state == "leaving" else rec.left_at
        return replace(rec, status=event.status, status_at=at, last_seen_at=at, left_at=left_at, last_event=event)
    if isinstance(event, InterruptionNotice):
        seen_by_agent = event.source == "imds"
        return replace(
            rec,
            notice_at=rec.notice_at if rec.notice_at is not None else at,
            # Keep the earliest deadline any source gave: acting late is the expensive mistake.
            notice_deadline=min(rec.notice_deadline, event.action_time)
            if rec.notice_deadline is not None
            else event.action_time,
            notice_action=event.action,
            notice_sources=rec.notice_sources | {event.source},
            last_seen_at=at if seen_by_agent else rec.last_seen_at,
            last_event=event,
        )
    if isinstance(event, RebalanceRecommended):
        return replace(
            rec,
            rebalance_at=rec.rebalance_at if rec.rebalance_at is not None else at,
            rebalance_sources=rec.rebalance_sources | {event.source},
            last_seen_at=at if event.source == "imds" else rec.last_seen_at,
            last_event=event,
        )
    if isinstance(event, InstanceStateChanged):
        return replace(rec, ec2_state=event.state, ec2_state_at=at, last_event=event)
    if isinstance(event, TrainingEvent):
        if isinstance(event.message, TrainerExited):
            return replace(
                rec,
                last_seen_at=at,
                left_at=_latest(rec.left_at, at),
                exit_reason=event.message.reason,
                exit_at=at,
                exit_code=event.message.exit_code,
                last_event=event,
            )
        return replace(rec, last_seen_at=at, last_event=event)
    raise TypeError(f"unknown intake event {type(event).__name__}")
