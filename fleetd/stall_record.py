"""The stalls fleetd saw, as data other processes read: ``status.json`` carries the current view
(fleetd/snapshot.py), and ``<fleet.state_dir>/stalls.json`` keeps every stall across daemon
restarts for ``fleetd report`` (stalled node-time is billed time that produced no step).

Versioned pydantic models like every other cross-process payload; written atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fleetd.atomic_file import write_atomically
from fleetd.policy.stall import Episode, StallTracker
from fleetd.protocol.errors import ProtocolError

STALLS_VERSION = 1
STALLS_NAME = "stalls.json"
KEEP = 50

NonNegative = Annotated[float, Field(ge=0)]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StallEpisodeView(_Frozen):
    since: float  # the last step before the stall (epoch seconds)
    detected_at: float
    cause: str
    billed_nodes: int
    node_seconds: NonNegative  # billed node-time without a step
    actions: tuple[str, ...] = ()  # "<recovery> at <epoch s>"
    ended_at: float | None = None  # the first step after it (None: still stalled)

    @property
    def duration_s(self) -> float | None:
        return None if self.ended_at is None else self.ended_at - self.since

    @property
    def recovery_s(self) -> float | None:
        return None if self.ended_at is None else self.ended_at - self.detected_at


class StallView(_Frozen):
    schema_version: int = STALLS_VERSION
    stalled: bool = False
    current: StallEpisodeView | None = None
    episodes: tuple[StallEpisodeView, ...] = ()  # ended ones, oldest first (the last KEEP)
    stalls: int = 0  # every stall so far, the current one included
    stalled_node_seconds: NonNegative = 0.0
    stall_after_s: float = 0.0

    @field_validator("schema_version")
    @classmethod
    def _known(cls, v: int) -> int:
        if v > STALLS_VERSION:
            raise ValueError(f"stall record schema {v} is newer than this fleetd ({STALLS_VERSION})")
        return v


def episode_view(e: Episode) -> StallEpisodeView:
    return StallEpisodeView(
        since=e.since,
        detected_at=e.detected_at,
        cause=str(e.cause),
        billed_nodes=e.billed_nodes,
        node_seconds=round(e.node_seconds, 3),
        actions=tuple(f"{k} at {at:.3f}" for k, at in e.actions),
        ended_at=e.ended_at,
    )


def view(tracker: StallTracker, *, before: StallView | None = None, stall_after_s: float = 0.0) -> StallView:
    """The tracker's stalls, after those a previous daemon life recorded (``before``)."""
    old = before.episodes if before is not None else ()
    ended = (*old, *(episode_view(e) for e in tracker.history))[-KEEP:]
    current = episode_view(tracker.episode) if tracker.episode is not None else None
    prior_count = before.stalls if before is not None else 0
    prior_ns = before.stalled_node_seconds if before is not None else 0.0
    return StallView(
        stalled=current is not None,
        current=current,
        episodes=ended,
        stalls=prior_count + len(tracker.history) + (1 if current else 0),
        stalled_node_seconds=round(prior_ns + tracker.stalled_node_seconds, 3),
        stall_after_s=stall_after_s,
    )


def stalls_path(state_dir: Path) -> Path:
    return Path(state_dir) / STALLS_NAME


def write_stalls(state_dir: Path, record: StallView) -> None:
    """Atomically replace ``stalls.json``. Blocking: call it through asyncio.to_thread."""
    write_atomically(stalls_path(state_dir), record.model_dump_json().encode())


def read_stalls(state_dir: Path) -> StallView | None:
    """None when fleetd never recorded one; ProtocolError when the file is not readable as one."""
    try:
        data = stalls_path(state_dir).read_bytes()
    except FileNotFoundError:
        return None
    try:
        return StallView.model_validate_json(data)
    except ValidationError as err:
        raise ProtocolError(f"{stalls_path(state_dir)}: {err.errors(include_url=False)[0]['msg']}") from None


def closed_before(record: StallView | None) -> StallView | None:
    """What a restarted daemon carries over: the stalls that ended. A stall still open when the
    previous life stopped is measured again from its start by the new one (the watcher seeds its
    tracker with that start), so it is left out here and never counted twice."""
    if record is None:
        return None
    stalls, node_s = record.stalls, record.stalled_node_seconds
    if record.current is not None:
        stalls, node_s = stalls - 1, node_s - record.current.node_seconds
    return StallView(
        episodes=record.episodes,
        stalls=max(0, stalls),
        stalled_node_seconds=max(0.0, node_s),
        stall_after_s=record.stall_after_s,
    )
