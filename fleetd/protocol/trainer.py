"""The local channel between the training script and the agent on the same node.

The trainer (rank 0 of each node, through fleetd's training-side helper) sends small JSON
datagrams to the agent's unix datagram socket (``node.trainer_socket``): its progress (step,
steps/s, world size) and "checkpoint saved" reports. Datagrams are fire-and-forget on purpose:
the training loop must never block on, or fail because of, the agent (not running, restarting,
socket full). The agent turns these into telemetry and ``checkpoint-saved`` events.
"""

from __future__ import annotations

import socket
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Literal, TypeAlias

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from fleetd.protocol.errors import ProtocolError

TRAINER_SCHEMA_VERSION = 1
# A report is a few hundred bytes; anything near this is not ours.
MAX_DATAGRAM_BYTES = 4096

Step = Annotated[int, Field(ge=0)]


def _now() -> datetime:
    return datetime.now(UTC)


class _TrainerReport(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Annotated[int, Field(ge=1, le=TRAINER_SCHEMA_VERSION)] = TRAINER_SCHEMA_VERSION
    sent_at: AwareDatetime = Field(default_factory=_now)
    rank: Annotated[int, Field(ge=0)] = 0


class Progress(_TrainerReport):
    """Sent every few steps (the agent computes steps/s itself if the trainer leaves it out)."""

    kind: Literal["progress"] = "progress"
    step: Step
    steps_per_s: Annotated[float, Field(ge=0)] | None = None
    world_size: Annotated[int, Field(ge=1)] | None = None


class CheckpointSavedLocally(_TrainerReport):
    """All of this node's shard files for ``step`` are on local disk (upload comes next)."""

    kind: Literal["checkpoint-saved"] = "checkpoint-saved"
    step: Step
    world_size: Annotated[int, Field(ge=1)]
    path: str
    nbytes: Annotated[int, Field(ge=0)] = 0
    duration_s: Annotated[float, Field(ge=0)] = 0.0


TrainerReport: TypeAlias = Annotated[Progress | CheckpointSavedLocally, Field(discriminator="kind")]
_ADAPTER: TypeAdapter[TrainerReport] = TypeAdapter(TrainerReport)


def parse_report(data: bytes) -> TrainerReport:
    if len(data) > MAX_DATAGRAM_BYTES:
        raise ProtocolError(f"trainer report of {len(data)} bytes exceeds {MAX_DATAGRAM_BYTES}")
    try:
        return _ADAPTER.validate_json(data)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<report>'}: {e['msg']}" for e in err.errors(include_url=False)
        )
        raise ProtocolError(f"bad trainer report: {problems}") from None


def send_report(socket_path: str | Path, report: Progress | CheckpointSavedLocally) -> bool:
    """Send one report to the agent; never blocks, never raises. Returns whether it was sent.

    Safe to call from the training loop every step: a missing agent costs one failed syscall.
    """
    data = report.model_dump_json().encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.sendto(data, str(socket_path))
        return True
    except OSError:
        # No agent (ENOENT/ECONNREFUSED) or its queue is full (EAGAIN): drop; the next one follows.
        return False
