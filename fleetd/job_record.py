"""The job's state as files other processes read and write (versioned, written atomically):

- ``<fleet.state_dir>/job.json``: the job's lifecycle state (fleetd/policy/job_state.py), kept
  across daemon restarts; ``status.json`` carries the same view, ``fleetd report`` reads it.
- ``<fleet.state_dir>/cancel.json``: an operator's ``fleetd cancel``; the daemon picks it up on
  its next tick (the file outlives a daemon restart, so a cancel is never lost).
- ``<fleet.state_dir>/submit.json``: the job file ``fleetd job submit`` handed over; the daemon
  ships it (fleetd/jobs/submission.py), and a restarted daemon runs it instead of fleetd.toml's.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator

from fleetd.atomic_file import read_model, write_atomically
from fleetd.policy.job_state import JobRecord, JobState

JOB_VERSION = 1
JOB_NAME = "job.json"
CANCEL_NAME = "cancel.json"
SUBMIT_NAME = "submit.json"


class _Versioned(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_version: int = JOB_VERSION

    @field_validator("schema_version")
    @classmethod
    def _known(cls, v: int) -> int:
        if v > JOB_VERSION:
            raise ValueError(f"job file schema {v} is newer than this fleetd ({JOB_VERSION})")
        return v


class JobView(_Versioned):
    state: JobState = JobState.PENDING
    since: float | None = None
    reason: str = ""
    restarts: int = 0  # user-code failures restarted so far
    ended_at: float | None = None
    final_step: int | None = None
    # The SHA-256 of the job's code that new nodes get (a job file's packed workdir); "" when
    # the code is baked into the image.
    code_digest: str = ""

    @property
    def terminal(self) -> bool:
        return JobRecord(state=self.state).terminal


class CancelRequest(_Versioned):
    reason: str
    requested_at: float


class SubmitRequest(_Versioned):
    file: Path  # absolute; the daemon reads it (and the workdir it names) as its own user
    digest: str  # the version as `fleetd job submit` packed it (the daemon packs it again)
    submitted_at: float


def view_of(rec: JobRecord, code_digest: str = "") -> JobView:
    kept = {name: getattr(rec, name) for name in JobView.model_fields if name not in ("schema_version", "code_digest")}
    return JobView(**kept, code_digest=code_digest)


def record_of(view: JobView) -> JobRecord:
    """The fold's memory back from the file (exits already counted are not kept: the registry
    of a new daemon life starts empty too)."""
    return JobRecord(**view.model_dump(exclude={"schema_version", "code_digest"}))


def read_job(state_dir: Path) -> JobView | None:
    return read_model(Path(state_dir) / JOB_NAME, JobView)


def write_job(state_dir: Path, view: JobView) -> None:
    write_atomically(Path(state_dir) / JOB_NAME, view.model_dump_json(indent=1).encode(), mode=0o640)


def read_cancel(state_dir: Path) -> CancelRequest | None:
    return read_model(Path(state_dir) / CANCEL_NAME, CancelRequest)


def write_cancel(state_dir: Path, request: CancelRequest) -> Path:
    return write_atomically(Path(state_dir) / CANCEL_NAME, request.model_dump_json().encode(), mode=0o640)


def clear_cancel(state_dir: Path) -> None:
    """A new run of the job (another version after the last one ended) starts uncancelled."""
    (Path(state_dir) / CANCEL_NAME).unlink(missing_ok=True)


def read_submit(state_dir: Path) -> SubmitRequest | None:
    return read_model(Path(state_dir) / SUBMIT_NAME, SubmitRequest)


def write_submit(state_dir: Path, request: SubmitRequest) -> Path:
    return write_atomically(Path(state_dir) / SUBMIT_NAME, request.model_dump_json().encode(), mode=0o640)
