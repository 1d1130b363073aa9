"""The control host's copy of the workers' output: where it lies and what a line looks like.

    <state_dir>/logs/<job>/<instance-id>.log      newest
    <state_dir>/logs/<job>/<instance-id>.log.1    older, up to .log.<KEEP>

One line per worker line: ``<UTC time> <rank or -> <text>``. The time is when the node sent the
batch (every line of a batch shares it): enough to interleave nodes to the second, which is what
``fleetd logs`` does. The files outlive the nodes: that is their point (a terminated spot node
takes its journal with it). Written by fleetd/joblogs/store.py, read by ``fleetd logs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

KEEP = 3  # rotated files kept per node, besides the one being written
MAX_BYTES = 16 * 1024 * 1024  # per file


def job_dir(state_dir: Path, job: str) -> Path:
    return state_dir / "logs" / job


def node_file(state_dir: Path, job: str, instance_id: str) -> Path:
    return job_dir(state_dir, job) / f"{instance_id}.log"


def rotated(path: Path, n: int) -> Path:
    return path.with_name(f"{path.name}.{n}")


def format_line(at: datetime, rank: int | None, text: str) -> str:
    stamp = at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    # A worker's line holds no newline (the node splits on them); a stray \r must not either.
    return f"{stamp} {'-' if rank is None else rank} {text.replace(chr(10), ' ')}\n"


@dataclass(frozen=True, slots=True)
class StoredLine:
    at: str  # ISO UTC, sorts as text
    rank: int | None
    text: str


def parse_line(line: str) -> StoredLine | None:
    """A line of a node's file, or None for one that is not (a torn last line, a hand edit)."""
    parts = line.rstrip("\n").split(" ", 2)
    if len(parts) < 2 or not parts[0].endswith("Z"):
        return None
    rank = None if parts[1] == "-" else int(parts[1]) if parts[1].isdigit() else None
    if rank is None and parts[1] != "-":
        return None
    return StoredLine(parts[0], rank, parts[2] if len(parts) == 3 else "")


def node_files(state_dir: Path, job: str) -> dict[str, list[Path]]:
    """Every node with lines for the job (gone ones too), each with its files oldest first."""
    out: dict[str, list[Path]] = {}
    folder = job_dir(state_dir, job)
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.log")):
        older = [rotated(path, n) for n in range(KEEP, 0, -1) if rotated(path, n).exists()]
        out[path.name[: -len(".log")]] = [*older, path]
    return out
