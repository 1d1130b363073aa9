"""Keys fleetd, the agents and the training ranks share in the rendezvous store (a cross-process
contract), and the versioned values stored under them.

The store is the fastest channel every rank reaches, so the checkpoint handshake runs through it:
requests, acks, hold and release, rank 0's progress counter, and a leaver's drain-ready, leave and
left keys (docs/DESIGN.md "One interruption, end to end"). Values are JSON of frozen pydantic
models with ``schema_version``; anything else raises :class:`~fleetd.protocol.errors.ProtocolError`.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, TypeVar

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from fleetd.protocol.errors import ProtocolError

SCHEMA_VERSION = 1
ROOT = "fleetd"
# torchrun keeps its rendezvous state under this key (torch/distributed/elastic/rendezvous/
# c10d_rendezvous_backend.py); fleetd reads and steers it.
TORCH_STATE_PREFIX = "torch.rendezvous."

_ADDR = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
Step = Annotated[int, Field(ge=0)]
Seq = Annotated[int, Field(ge=1)]


# The rendezvous host writes a fresh value here each time it starts. The store lives in memory
# only: a value that changed (or vanished) tells every client the store restarted empty, so the
# rendezvous state, checkpoint requests and drain keys of before are gone (DESIGN.md, failure model).
HOST_INCARNATION_KEY = "fleetd.host.incarnation"


def torch_state_key(run_id: str) -> str:
    return TORCH_STATE_PREFIX + run_id


def _base(run_id: str) -> str:
    return f"{ROOT}.{run_id}"


def _addr(addr: str) -> str:
    if not _ADDR.match(addr):
        raise ProtocolError(f"node address {addr!r} cannot be part of a store key")
    return addr


# Requesters take a number with an atomic ``add``; rank 0 reads it each step with ``add(key, 0)``
# (one round trip, never blocks) and the ranks agree on it, so all save at the same step.
def request_seq_key(run_id: str) -> str:
    return f"{_base(run_id)}.ckpt.seq"


# One key per request number: two requesters never overwrite each other.
def request_key(run_id: str, seq: int) -> str:
    return f"{_base(run_id)}.ckpt.request.{seq}"


def ack_key(run_id: str, seq: int, rank: int) -> str:
    return f"{_base(run_id)}.ckpt.ack.{seq}.{rank}"


def ack_count_key(run_id: str, seq: int) -> str:
    return f"{_base(run_id)}.ckpt.ack.{seq}.count"


def release_key(run_id: str, seq: int) -> str:
    return f"{_base(run_id)}.ckpt.release.{seq}"


def progress_key(run_id: str) -> str:
    """A counter rank 0 bumps (``add(key, 1)``) while training advances: the job's pulse."""
    return f"{_base(run_id)}.progress"


# Rank 0 bumps the progress counter at most this often: one store round trip per half second, not
# per step; fleetd's hang threshold (loss.hang_after_s) is many times longer.
PROGRESS_EVERY_S = 0.5


def drain_ready_key(run_id: str, addr: str) -> str:
    return f"{_base(run_id)}.node.{_addr(addr)}.drain_ready"


def leave_key(run_id: str, addr: str) -> str:
    return f"{_base(run_id)}.node.{_addr(addr)}.leave"


def left_key(run_id: str, addr: str) -> str:
    return f"{_base(run_id)}.node.{_addr(addr)}.left"


def noticed_key(run_id: str, addr: str) -> str:
    """Set by a member's agent as its notice flow starts (before its checkpoint is acknowledged):
    fleetd's steering holds the survivors' re-form briefly for every member of the same wave."""
    return f"{_base(run_id)}.node.{_addr(addr)}.noticed"


def member_key(run_id: str, addr: str) -> str:
    """Set by a node's training worker when it starts in a world: the node holds training state.
    A node without it (a replacement still restoring) has nothing to checkpoint on a notice."""
    return f"{_base(run_id)}.node.{_addr(addr)}.member"


def salvaged_key(run_id: str) -> str:
    """The newest step a survivor saved after a peer's loss (its node's disk, then S3 through its
    agent): a world that forms without that node waits, bounded, for it to become durable
    instead of resuming from an older step (agent/trainer/resume.py)."""
    return f"{_base(run_id)}.salvaged"


def _now() -> datetime:
    return datetime.now(UTC)


class _Value(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_version: int = SCHEMA_VERSION

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


class CheckpointRequest(_Value):
    """Save at the next step all ranks agree on. ``hold``: then wait for the membership change."""

    seq: Seq
    reason: Annotated[str, Field(max_length=200)]
    hold: bool = False
    leaving: tuple[str, ...] = ()  # node addresses whose departure this checkpoint protects
    requested_at: AwareDatetime = Field(default_factory=_now)
    requested_by: Annotated[str, Field(max_length=128)] = ""


# How long fleetd's steering waits for the staying nodes' copies of a step their leavers held
# without saving (agent/trainer/hold_plan.py) before it re-forms them anyway.
HELD_SAVE_WAIT_S = 30.0


class CheckpointAck(_Value):
    """One rank saved step ``step`` for request ``seq``; with ``held_only``, it stopped at that
    step and saved nothing: its node leaves, and nodes that stay hold the step (replicated state,
    agent/trainer/hold_plan.py)."""

    seq: Seq
    step: Step
    rank: Annotated[int, Field(ge=0)]
    world_size: Annotated[int, Field(ge=1)]
    node_addr: str = ""
    local_dir: str = ""  # the step's directory on that node
    held_only: bool = False
    local_world_size: Annotated[int, Field(ge=1)] = 1  # ranks on that node (a leaver waits for all)
    saved_at: AwareDatetime = Field(default_factory=_now)


class DrainReady(_Value):
    """The leaving node's checkpoint shard for ``step`` is durable (or the deadline forced it)."""

    step: Step | None
    durable: bool
    detail: str = ""


class Noticed(_Value):
    reason: Annotated[str, Field(max_length=200)] = ""
    at: AwareDatetime = Field(default_factory=_now)


class Member(_Value):
    """A training worker of this node started in a world of ``world_size`` ranks."""

    world_size: Annotated[int, Field(ge=1)]
    started_at: AwareDatetime = Field(default_factory=_now)


class Salvaged(_Value):
    """A survivor saved ``step`` on node ``addr`` (the highest such step is kept)."""

    step: Step
    addr: Annotated[str, Field(max_length=128)] = ""
    at: AwareDatetime = Field(default_factory=_now)


class Leave(_Value):
    reason: str = ""


class Left(_Value):
    exit_code: int | None = None


V = TypeVar("V", bound=_Value)


def parse_value(model: type[V], raw: bytes | str) -> V:
    """Decode one stored value; raise ProtocolError with a readable reason."""
    try:
        value = model.model_validate_json(raw)
    except ValidationError as err:
        raise ProtocolError(
            f"bad {model.__name__} in the rendezvous store: {err.errors(include_url=False)[:3]}"
        ) from None
    if value.schema_version > SCHEMA_VERSION:
        raise ProtocolError(f"{model.__name__} schema_version {value.schema_version} is newer than this build")
    return value
