"""The controller's internal event types: what both intakes (MQTT and EventBridge/SQS) produce.

The same fact arrives the same way whichever path brought it: a spot interruption notice from an
agent's IMDS (over MQTT) and one from EventBridge (over SQS) are both ``InterruptionNotice``,
differing only in ``source``. That is what lets the two-signal rule count them and the registry
merge them. Times are epoch seconds (UTC); ``dedup_key`` identifies one delivery for
de-duplication (MQTT ``msg_id`` or EventBridge event id).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias, TypedDict

from fleetd.protocol.messages import (
    CheckpointSaved,
    CheckpointUploaded,
    Message,
    Notice,
    Rebalance,
    Status,
    Telemetry,
    TrainerExited,
)

Source = Literal["imds", "eventbridge"]


@dataclass(frozen=True, slots=True)
class InterruptionNotice:
    instance_id: str
    action: Literal["terminate", "stop", "hibernate"]
    action_time: float  # when AWS will act
    source: Source
    received_at: float = field(default=0.0, compare=False)
    dedup_key: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class RebalanceRecommended:
    instance_id: str
    notice_time: float
    source: Source
    received_at: float = field(default=0.0, compare=False)
    dedup_key: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class InstanceStateChanged:
    """EC2 Instance State-change Notification (pending, running, stopping, stopped,
    shutting-down, terminated)."""

    instance_id: str
    state: str
    received_at: float = field(default=0.0, compare=False)
    dedup_key: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class AgentStatus:
    """The agent's retained status; ``state == "offline"`` is the last will (or a clean goodbye)."""

    instance_id: str
    status: Status
    received_at: float = field(default=0.0, compare=False)
    dedup_key: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class AgentTelemetry:
    instance_id: str
    telemetry: Telemetry
    received_at: float = field(default=0.0, compare=False)
    dedup_key: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class TrainingEvent:
    """checkpoint-saved, checkpoint-uploaded or trainer-exited, as the agent sent it."""

    instance_id: str
    message: CheckpointSaved | CheckpointUploaded | TrainerExited
    received_at: float = field(default=0.0, compare=False)
    dedup_key: str = field(default="", compare=False)


IntakeEvent: TypeAlias = (
    InterruptionNotice | RebalanceRecommended | InstanceStateChanged | AgentStatus | AgentTelemetry | TrainingEvent
)


class EventCommon(TypedDict):
    """The fields every intake event is built with (passed as ``**common``)."""

    instance_id: str
    received_at: float
    dedup_key: str


# Events that should wake the reconcile loop at once rather than wait for its next pass.
URGENT = (InterruptionNotice, RebalanceRecommended, InstanceStateChanged, AgentStatus, TrainingEvent)


def from_message(msg: Message, received_at: float) -> IntakeEvent | None:
    """Translate one validated agent message into an intake event (None: not for the controller)."""
    common: EventCommon = {"instance_id": msg.instance_id, "received_at": received_at, "dedup_key": msg.msg_id}
    if isinstance(msg, Notice):
        return InterruptionNotice(
            action=msg.action, action_time=msg.action_time.timestamp(), source=msg.source, **common
        )
    if isinstance(msg, Rebalance):
        return RebalanceRecommended(notice_time=msg.notice_time.timestamp(), source=msg.source, **common)
    if isinstance(msg, Status):
        return AgentStatus(status=msg, **common)
    if isinstance(msg, Telemetry):
        return AgentTelemetry(telemetry=msg, **common)
    if isinstance(msg, (CheckpointSaved, CheckpointUploaded, TrainerExited)):
        return TrainingEvent(message=msg, **common)
    return None  # commands are controller -> agent; an echo of our own is not an event
