"""Versioned wire messages between the controller and the agents (DESIGN.md, "Wire protocol").

Every payload is the JSON of one of these frozen models. Common envelope: ``schema_version``,
``kind`` (the discriminator), ``msg_id`` (for de-duplication of QoS 1 redeliveries),
``instance_id`` and ``sent_at`` (UTC). Unknown fields, unknown kinds and schema versions newer than
this build are rejected, so a half-upgraded fleet fails loudly instead of mis-reading fields.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Annotated, Literal, TypeAlias, get_args

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
)

from fleetd.protocol.errors import ProtocolError

SCHEMA_VERSION = 1

# Instance ids become MQTT topic levels: forbid the MQTT wildcards and separators outright.
InstanceId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
Step = Annotated[int, Field(ge=0)]


def _now() -> datetime:
    return datetime.now(UTC)


def _new_msg_id() -> str:
    return uuid.uuid4().hex


class _Envelope(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = SCHEMA_VERSION
    msg_id: Annotated[str, Field(min_length=1, max_length=64)] = Field(default_factory=_new_msg_id)
    instance_id: InstanceId
    sent_at: AwareDatetime = Field(default_factory=_now)

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v > SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {v} is newer than this build understands ({SCHEMA_VERSION}); "
                "upgrade fleetd/fleet-agent"
            )
        if v < 1:
            raise ValueError("schema_version must be >= 1")
        return v

    @field_validator("sent_at")
    @classmethod
    def _to_utc(cls, v: datetime) -> datetime:
        return v.astimezone(UTC)

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()


# ---------------------------------------------------------------- agent -> controller: status
NodeState = Literal["starting", "ready", "training", "draining", "leaving", "offline"]


class Status(_Envelope):
    """Retained on ``status``; the agent's last will is the same model with ``state="offline"``."""

    kind: Literal["status"] = "status"
    state: NodeState
    agent_version: str = ""
    instance_type: str = ""
    zone: str = ""
    lifecycle: Literal["spot", "on-demand", "unknown"] = "unknown"
    node_addr: str = ""
    # The job's code version the node runs (its user data's job.code_digest); "" when the code
    # is baked into the image. fleetd drains a node on another version than the job's.
    code_digest: Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$")] = ""


# ---------------------------------------------------------------- agent -> controller: telemetry
class GpuSample(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    index: Annotated[int, Field(ge=0)]
    util_pct: Annotated[float, Field(ge=0, le=100)]
    mem_used_mib: Annotated[float, Field(ge=0)]
    mem_total_mib: Annotated[float, Field(ge=0)]


class Telemetry(_Envelope):
    """About 1 Hz at QoS 0: losing one is harmless, the next replaces it."""

    kind: Literal["telemetry"] = "telemetry"
    gpus: tuple[GpuSample, ...] = ()
    cpu_pct: Annotated[float, Field(ge=0, le=100)] = 0.0
    mem_used_pct: Annotated[float, Field(ge=0, le=100)] = 0.0
    step: Step | None = None
    steps_per_s: Annotated[float, Field(ge=0)] | None = None
    world_size: Annotated[int, Field(ge=0)] | None = None

    @property
    def gpu_util_pct(self) -> float | None:
        """Mean utilisation over the node's GPUs; None on a node without GPUs."""
        if not self.gpus:
            return None
        return sum(g.util_pct for g in self.gpus) / len(self.gpus)


# ---------------------------------------------------------------- agent -> controller: events
class Notice(_Envelope):
    """A spot interruption notice (IMDS ``spot/instance-action`` or EventBridge)."""

    kind: Literal["notice"] = "notice"
    action: Literal["terminate", "stop", "hibernate"]
    action_time: AwareDatetime
    source: Literal["imds", "eventbridge"] = "imds"


class Rebalance(_Envelope):
    """A rebalance recommendation: elevated risk, not a drain (DESIGN.md)."""

    kind: Literal["rebalance"] = "rebalance"
    notice_time: AwareDatetime
    source: Literal["imds", "eventbridge"] = "imds"


class CheckpointSaved(_Envelope):
    kind: Literal["checkpoint-saved"] = "checkpoint-saved"
    step: Step
    world_size: Annotated[int, Field(ge=1)]
    nbytes: Annotated[int, Field(ge=0)] = 0
    duration_s: Annotated[float, Field(ge=0)] = 0.0


class CheckpointUploaded(_Envelope):
    kind: Literal["checkpoint-uploaded"] = "checkpoint-uploaded"
    step: Step
    files: Annotated[int, Field(ge=0)]
    nbytes: Annotated[int, Field(ge=0)]
    s3_prefix: str
    duration_s: Annotated[float, Field(ge=0)]
    beat_deadline: bool | None = None
    # Step N's manifest exists (every expected writer's shards are in): the step is durable.
    complete: bool = False


class TrainerExited(_Envelope):
    kind: Literal["trainer-exited"] = "trainer-exited"
    exit_code: int | None
    reason: str = ""
    last_step: Step | None = None


# ---------------------------------------------------------------- agent -> controller: logs
# A job name becomes a folder on the control host (<state_dir>/logs/<job>/): no separators, no dots first.
JobName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")]


class LogLine(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    text: Annotated[str, Field(max_length=8192)]
    rank: Annotated[int, Field(ge=0)] | None = None  # torchrun's local rank, when its prefix said


class WorkerLogs(_Envelope):
    """A batch of the workers' output (agent/node/log_batcher.py). ``stream`` names one agent
    run, ``seq`` counts its batches from 0 (the controller drops a (stream, seq) it has already
    written), ``first_line`` is the stream offset of ``lines[0]`` counting dropped lines too, and
    ``dropped`` says how many lines the rate cap dropped just before this batch."""

    kind: Literal["worker-logs"] = "worker-logs"
    job: JobName
    stream: Annotated[str, Field(min_length=1, max_length=64)]
    seq: Annotated[int, Field(ge=0)]
    first_line: Annotated[int, Field(ge=0)]
    dropped: Annotated[int, Field(ge=0)] = 0
    lines: Annotated[tuple[LogLine, ...], Field(max_length=4096)] = ()


# ---------------------------------------------------------------- controller -> agent: commands
class CheckpointCommand(_Envelope):
    """Save (and upload) a checkpoint as soon as all ranks agree on a step."""

    kind: Literal["checkpoint"] = "checkpoint"
    reason: str
    deadline: AwareDatetime | None = None


class DrainCommand(_Envelope):
    """Checkpoint, upload this node's shard, then wait for ``leave``."""

    kind: Literal["drain"] = "drain"
    reason: str
    deadline: AwareDatetime | None = None


class LeaveCommand(_Envelope):
    """The controller has removed the node from the rendezvous: stop torchrun's process tree now."""

    kind: Literal["leave"] = "leave"
    reason: str


class ShutdownCommand(_Envelope):
    """The job is over (or the budget is spent): stop training and the agent cleanly."""

    kind: Literal["shutdown"] = "shutdown"
    reason: str


class RestartTrainerCommand(_Envelope):
    """Training stalled with the trainer not running (it failed, or gave up while the store was
    away): start torchrun again. fleetd's stall recovery sends it (fleetd/policy/stall.py)."""

    kind: Literal["restart-trainer"] = "restart-trainer"
    reason: str


Event: TypeAlias = Annotated[
    Notice | Rebalance | CheckpointSaved | CheckpointUploaded | TrainerExited,
    Field(discriminator="kind"),
]
Command: TypeAlias = Annotated[
    CheckpointCommand | DrainCommand | LeaveCommand | ShutdownCommand | RestartTrainerCommand,
    Field(discriminator="kind"),
]
Message: TypeAlias = Annotated[
    Status
    | Telemetry
    | Notice
    | Rebalance
    | CheckpointSaved
    | CheckpointUploaded
    | TrainerExited
    | WorkerLogs
    | CheckpointCommand
    | DrainCommand
    | LeaveCommand
    | ShutdownCommand
    | RestartTrainerCommand,
    Field(discriminator="kind"),
]

_MESSAGE_ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)
# Every kind, read off the union itself so the two can never disagree.
MESSAGE_KINDS: frozenset[str] = frozenset(m.model_fields["kind"].default for m in get_args(get_args(Message)[0]))


def describe_validation_error(err: ValidationError) -> str:
    """One line per problem, each naming the field path: what an operator reads in the log."""
    parts = []
    for e in err.errors(include_url=False):
        loc = ".".join(str(p) for p in e["loc"]) or "<message>"
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        elif e["type"] == "union_tag_invalid":
            msg = (
                f"unknown kind {e.get('input', {}).get('kind')!r}"
                if isinstance(e.get("input"), dict)
                else "unknown kind"
            )
        elif e["type"] == "union_tag_not_found":
            msg = "missing 'kind'"
        else:
            msg = e["msg"]
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def parse_message(payload: bytes | str) -> Message:
    """Decode and validate one payload; raise ProtocolError with a readable reason."""
    try:
        return _MESSAGE_ADAPTER.validate_json(payload)
    except ValidationError as err:
        raise ProtocolError(describe_validation_error(err)) from None


# ---------------------------------------------------------------- controller -> agents: the store
class RendezvousEndpoint(BaseModel):
    """Where the job's rendezvous store is, published retained on ``fleetd/<fleet>/rendezvous``
    by the controller that leads (DESIGN.md, "High availability"): after a failover it names
    the new leader's store. ``generation``: the leader's lease generation (a newer one wins)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = SCHEMA_VERSION
    kind: Literal["rendezvous-endpoint"] = "rendezvous-endpoint"
    host: Annotated[str, Field(min_length=1, max_length=253)]
    port: Annotated[int, Field(ge=1, le=65535)]
    run_id: Annotated[str, Field(min_length=1, max_length=128)]
    leader: Annotated[str, Field(min_length=1, max_length=128)]
    generation: Annotated[int, Field(ge=0)]
    sent_at: AwareDatetime = Field(default_factory=_now)

    _known_version = field_validator("schema_version")(_Envelope._known_version.__func__)  # type: ignore[attr-defined]

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()


def parse_endpoint(payload: bytes | str) -> RendezvousEndpoint:
    try:
        return RendezvousEndpoint.model_validate_json(payload)
    except ValidationError as err:
        raise ProtocolError(describe_validation_error(err)) from None
