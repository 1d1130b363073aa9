"""``<fleet.state_dir>/allotment.json``: a job's share of the team, written by ``fleetd team`` (the
arbiter), read by the job's daemon before every pass (fleetd/team/member.py).

A file, not a message: the arbiter and each job's daemon are separate processes (one crash stops
one job, not the team), the daemon needs the newest share at any moment and after a restart, and an
atomic rename gives it a complete one or the previous one, never half of either. Versioned like
every other cross-process payload; a reader refuses a newer schema or a malformed file, and the
daemon then keeps buying nothing (fleetd/team/member.py): a share it cannot read is no share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleetd.atomic_file import read_model, write_atomically
from fleetd.policy.team_model import TeamActionKind

ALLOTMENT_VERSION = 1
ALLOTMENT_NAME = "allotment.json"

NonNegative = Annotated[float, Field(ge=0)]


class AllotmentRecord(BaseModel):
    """One job's share, as of ``written_at`` (the arbiter's clock, epoch seconds).

    ``total_usd`` is the most this job may have spent, ever: its spend when the arbiter wrote this
    plus its part of what the team has left (in proportion to its allotted burn). The parts add up
    to the team's total, so the team stays inside it even if the arbiter stops writing and every
    daemon runs on its last share.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    schema_version: int = ALLOTMENT_VERSION
    team: str
    job: str
    written_at: float
    kind: TeamActionKind
    nodes: Annotated[int, Field(ge=0)]
    usd_per_hour: NonNegative
    total_usd: NonNegative
    region: str | None = None
    reason: str = ""
    paused_at: float | None = None  # when the job's current pause began (kind pause / paused)

    @field_validator("schema_version")
    @classmethod
    def _known(cls, v: int) -> int:
        if v > ALLOTMENT_VERSION:
            raise ValueError(f"allotment schema {v} is newer than this fleetd ({ALLOTMENT_VERSION})")
        return v


def read_allotment(state_dir: Path) -> AllotmentRecord | None:
    """None when no allotment was written yet; ProtocolError when the file is not a valid one."""
    return read_model(Path(state_dir) / ALLOTMENT_NAME, AllotmentRecord)


def write_allotment(state_dir: Path, record: AllotmentRecord) -> Path:
    return write_atomically(Path(state_dir) / ALLOTMENT_NAME, record.model_dump_json(indent=1).encode(), mode=0o640)
