"""The checkpoint layout in S3, shared by the agent (writes, restores) and the controller (reads).

Layout and publishing: docs/DESIGN.md "Durable checkpoints". Every object read back from S3 is
parsed here; anything malformed (bad JSON, unknown schema, a path escaping the step directory, a
manifest for another step) raises ProtocolError, so a bad object is rejected with a clear reason
instead of being half-trusted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import Annotated, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from fleetd.protocol.digests import Checksum
from fleetd.protocol.errors import ProtocolError

CHECKPOINT_SCHEMA_VERSION = 1
MANIFEST_NAME = "MANIFEST.json"
RECEIPTS_DIR = "_parts"
LATEST_NAME = "latest"

Writer = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
Job = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
Step = Annotated[int, Field(ge=0)]

_STEP_DIR = re.compile(r"^step-(0|[1-9][0-9]{0,17})$")
_NAME_PART = re.compile(r"^[A-Za-z0-9_.=+-]{1,200}$")


def _now() -> datetime:
    return datetime.now(UTC)


def validate_file_name(name: str) -> str:
    """A shard file's name relative to the step directory: posix, no '..', not a reserved name."""
    path = PurePosixPath(name)
    if not name or name.startswith("/") or "\\" in name or str(path) != name:
        raise ValueError(f"file name {name!r} must be a normalised relative posix path")
    parts = path.parts
    if any(p in (".", "..") or not _NAME_PART.match(p) for p in parts):
        raise ValueError(f"file name {name!r} has a forbidden component")
    if parts[0] == RECEIPTS_DIR or name == MANIFEST_NAME:
        raise ValueError(f"file name {name!r} is reserved by the checkpoint layout")
    return name


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = CHECKPOINT_SCHEMA_VERSION

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if not 1 <= v <= CHECKPOINT_SCHEMA_VERSION:
            raise ValueError(
                f"checkpoint schema_version {v} is not understood by this build "
                f"(knows 1..{CHECKPOINT_SCHEMA_VERSION}); upgrade fleetd/fleet-agent"
            )
        return v

    def to_json(self) -> bytes:
        return self.model_dump_json(indent=1).encode()


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    size: Annotated[int, Field(ge=0)]
    checksum: Checksum

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return validate_file_name(v)


def _unique_sorted(files: tuple[FileEntry, ...]) -> tuple[FileEntry, ...]:
    names = [f.name for f in files]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"file names listed more than once: {dupes}")
    return tuple(sorted(files, key=lambda f: f.name))


class WriterReceipt(_Model):
    """One node's confirmation that all of its files of step N are in S3 (step-N/_parts/W.json)."""

    kind: Literal["checkpoint-receipt"] = "checkpoint-receipt"
    job: Job
    step: Step
    writer: Writer
    world_size: Annotated[int, Field(ge=1)]
    expected_writers: tuple[Writer, ...]
    files: tuple[FileEntry, ...]
    # Sharded (torch DCP) state: every file of the step across all nodes, as its ``.metadata``
    # names them. Only the node holding ``.metadata`` knows it; the step is complete once the
    # receipts together hold all of these files, whichever nodes wrote them.
    step_files: tuple[str, ...] | None = None
    created_at: AwareDatetime = Field(default_factory=_now)

    @field_validator("files")
    @classmethod
    def _files(cls, v: tuple[FileEntry, ...]) -> tuple[FileEntry, ...]:
        return _unique_sorted(v)

    @field_validator("step_files")
    @classmethod
    def _step_files(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return None if v is None else tuple(sorted({validate_file_name(n) for n in v}))

    @property
    def is_shard(self) -> bool:
        """Part of a sharded checkpoint: complete only together with the other nodes' parts."""
        return self.step_files is not None or any(is_shard_file(f.name) for f in self.files)

    @field_validator("expected_writers")
    @classmethod
    def _writers(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("expected_writers must not be empty")
        return tuple(sorted(set(v)))


class Manifest(_Model):
    """Step N is complete, and exactly these files (size + checksum) make it up."""

    kind: Literal["checkpoint-manifest"] = "checkpoint-manifest"
    job: Job
    step: Step
    world_size: Annotated[int, Field(ge=1)]
    writers: tuple[Writer, ...]
    # The node whose merge of the receipts won the conditional create of MANIFEST.json.
    writer: Writer
    files: tuple[FileEntry, ...]
    created_at: AwareDatetime = Field(default_factory=_now)

    @field_validator("files")
    @classmethod
    def _files(cls, v: tuple[FileEntry, ...]) -> tuple[FileEntry, ...]:
        if not v:
            raise ValueError("a manifest lists at least one file")
        return _unique_sorted(v)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def same_content(self, other: Manifest) -> bool:
        """Equal apart from who merged it and when (two merges of the same receipts are)."""
        keys = ("job", "step", "world_size", "writers", "files")
        return all(getattr(self, k) == getattr(other, k) for k in keys)


class LatestPointer(_Model):
    kind: Literal["checkpoint-latest"] = "checkpoint-latest"
    job: Job
    step: Step
    writer: Writer
    updated_at: AwareDatetime = Field(default_factory=_now)


DCP_METADATA = ".metadata"


def is_shard_file(name: str) -> bool:
    """A torch.distributed.checkpoint file (its data files, or the metadata naming them)."""
    return name.endswith(".distcp") or name == DCP_METADATA


def shard_receipts_complete(receipts: Iterable[WriterReceipt]) -> list[WriterReceipt] | None:
    """The receipts that make up a sharded step, once together they hold every file its
    metadata names (and the metadata itself); None while some are missing."""
    receipts = [r for r in receipts if r.is_shard]
    names = next((r.step_files for r in receipts if r.step_files is not None), None)
    if names is None:
        return None
    wanted = set(names) | {DCP_METADATA}
    have = {f.name for r in receipts for f in r.files}
    if not wanted <= have:
        return None
    return [r for r in receipts if any(f.name in wanted for f in r.files)]


def merge_receipts(receipts: Iterable[WriterReceipt], *, job: str, step: int, merged_by: str) -> Manifest:
    """The manifest of step N from every expected writer's receipt; ProtocolError if any is missing
    or they disagree (another step, another world size, two writers claiming the same file)."""
    by_writer = {r.writer: r for r in receipts}
    if not by_writer:
        raise ProtocolError(f"step {step}: no receipts to merge")
    expected = {w for r in by_writer.values() for w in r.expected_writers}
    missing = sorted(expected - by_writer.keys())
    if missing:
        raise ProtocolError(f"step {step}: receipts missing from writers {missing}")
    world_sizes = {r.world_size for r in by_writer.values()}
    if any(r.step != step or r.job != job for r in by_writer.values()) or len(world_sizes) != 1:
        raise ProtocolError(f"step {step}: receipts disagree on job, step or world size")
    files = [f for r in by_writer.values() for f in r.files]
    try:
        return Manifest(
            job=job,
            step=step,
            world_size=world_sizes.pop(),
            writers=tuple(sorted(by_writer)),
            writer=merged_by,
            files=tuple(files),
        )
    except ValidationError as err:
        raise ProtocolError(f"step {step}: receipts cannot be merged: {_first_error(err)}") from None


def _first_error(err: ValidationError) -> str:
    e = err.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in e["loc"]) or "<root>"
    return f"{loc}: {e['msg']}"


def _parse(model: type[_Model], data: bytes, source: str) -> _Model:
    try:
        return model.model_validate_json(data)
    except ValidationError as err:
        raise ProtocolError(f"{source}: not a valid {model.__name__}: {_first_error(err)}") from None


def parse_manifest(data: bytes, *, source: str, job: str, step: int) -> Manifest:
    m = _parse(Manifest, data, source)
    assert isinstance(m, Manifest)
    if m.job != job or m.step != step:
        raise ProtocolError(f"{source}: manifest is for {m.job}/step-{m.step}, not {job}/step-{step}")
    return m


def parse_receipt(data: bytes, *, source: str, job: str, step: int) -> WriterReceipt:
    r = _parse(WriterReceipt, data, source)
    assert isinstance(r, WriterReceipt)
    if r.job != job or r.step != step:
        raise ProtocolError(f"{source}: receipt is for {r.job}/step-{r.step}, not {job}/step-{step}")
    return r


def parse_latest(data: bytes, *, source: str, job: str) -> LatestPointer:
    p = _parse(LatestPointer, data, source)
    assert isinstance(p, LatestPointer)
    if p.job != job:
        raise ProtocolError(f"{source}: latest pointer is for job {p.job}, not {job}")
    return p


class CheckpointLayout:
    """Key builders and parsers for one job's checkpoints: the only place key names are made."""

    def __init__(self, prefix: str, job: str):
        if not re.match(r"^[A-Za-z0-9_.-]{1,64}$", job):
            raise ValueError(f"job name {job!r} is not a valid key component")
        self.job = job
        self.job_prefix = "/".join(p for p in (prefix.strip("/"), job) if p) + "/"

    def step_prefix(self, step: int) -> str:
        if step < 0:
            raise ValueError("step must be >= 0")
        return f"{self.job_prefix}step-{step}/"

    def file_key(self, step: int, name: str) -> str:
        return self.step_prefix(step) + validate_file_name(name)

    def manifest_key(self, step: int) -> str:
        return self.step_prefix(step) + MANIFEST_NAME

    def receipts_prefix(self, step: int) -> str:
        return f"{self.step_prefix(step)}{RECEIPTS_DIR}/"

    def receipt_key(self, step: int, writer: str) -> str:
        if not re.match(r"^[A-Za-z0-9_.:-]{1,64}$", writer):
            raise ValueError(f"writer name {writer!r} is not a valid key component")
        return f"{self.receipts_prefix(step)}{writer}.json"

    def latest_key(self) -> str:
        return self.job_prefix + LATEST_NAME

    def step_of_prefix(self, common_prefix: str) -> int | None:
        """N for ``<job_prefix>step-N/`` (a ListObjectsV2 CommonPrefix); None for anything else."""
        if not common_prefix.startswith(self.job_prefix):
            return None
        m = _STEP_DIR.match(common_prefix[len(self.job_prefix) :].rstrip("/"))
        return int(m.group(1)) if m else None

    def step_of_key(self, key: str) -> int | None:
        """N for any key under ``<job_prefix>step-N/``; None otherwise."""
        if not key.startswith(self.job_prefix):
            return None
        head = key[len(self.job_prefix) :].split("/", 1)[0]
        m = _STEP_DIR.match(head)
        return int(m.group(1)) if m else None
