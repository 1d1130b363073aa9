"""Checkpoints on the node's local disk: ``<ckpt_dir>/step-<N>/`` (the same name the S3 restore
uses), written into a temporary directory and renamed into place, with a completion marker.

Two formats:
- ``state_dict``: replicated state (DDP). Local rank 0 of each node writes ``state.pt``; every
  node then holds a complete copy, so survivors resume without any download.
- ``dcp``: torch.distributed.checkpoint (sharded). Each rank writes its own files; a node's
  directory is complete only when ``.metadata`` and every file it names are present (a multi-node
  checkpoint becomes complete locally after a restore from S3).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from fleetd.protocol.checkpoints import DCP_METADATA, is_shard_file

Mode = Literal["state_dict", "dcp"]
MARKER = "fleetd-complete.json"
PLAIN_FILE = "state.pt"
_STEP_DIR = re.compile(r"^step-(0|[1-9][0-9]*)$")


@dataclass(frozen=True, slots=True)
class SavedStep:
    step: int
    directory: Path
    nbytes: int
    duration_s: float
    files: tuple[Path, ...]


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def local_steps(root: Path) -> list[int]:
    """Steps with a directory under ``root``, newest first (complete or not)."""
    if not root.is_dir():
        return []
    out = [int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(out, reverse=True)


def is_complete(directory: Path, mode: Mode) -> bool:
    if mode == "state_dict":
        return (directory / MARKER).is_file() and (directory / PLAIN_FILE).is_file()
    names = dcp_file_names(directory)
    return names is not None and all((directory / n).is_file() for n in names)


def dcp_file_names(directory: Path) -> tuple[str, ...] | None:
    """Every file of a DCP checkpoint, ``.metadata`` included, as its metadata names them (on
    any node, wherever they were written); None without a readable ``.metadata`` here."""
    if not (directory / DCP_METADATA).is_file():
        return None
    try:
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        storage = FileSystemReader(str(directory)).read_metadata().storage_data or {}
    except Exception:  # noqa: BLE001 - an unreadable metadata file means "not usable", not a crash
        return None
    names = {getattr(info, "relative_path", None) for info in storage.values()}
    if not all(isinstance(n, str) and n for n in names):
        return None
    return tuple(sorted(cast("set[str]", names) | {DCP_METADATA}))  # every one a str, checked above


def upload_set(directory: Path) -> tuple[list[Path], tuple[str, ...] | None]:
    """What a node uploads of a local step: its files and, for sharded state, the names of every
    file of the step when this node holds the metadata (the S3 publisher completes the step when
    the nodes' parts add up to it). The completion marker stays local in both modes: every node
    has its own (its own ``saved_at``), so with replicated state, where every node uploads the
    same keys, a later node's marker overwrote the one the manifest hashed and no node could
    restore the step from S3 (sha256 mismatch: the whole-fleet loss had nothing to resume from).
    A restored step is judged by its metadata (sharded) or given a marker by the restore."""
    files = [p for p in _files(directory) if p.name != MARKER]
    if not any(is_shard_file(p.name) for p in files):
        return files, None  # replicated state: each node's copy is the whole step
    return files, dcp_file_names(directory)


def newest_complete(root: Path, mode: Mode) -> int | None:
    for step in local_steps(root):
        if is_complete(step_dir(root, step), mode):
            return step
    return None


def _files(directory: Path) -> tuple[Path, ...]:
    return tuple(sorted(p for p in directory.rglob("*") if p.is_file()))


def _finish(tmp: Path, final: Path, step: int, mode: Mode, started: float) -> SavedStep:
    # The same bytes on every node: with replicated state each node uploads its whole copy under
    # the same keys, and the manifest (one node's hashes) must match whichever copy lands last.
    # (A save time in it made `latest` name steps that failed verification: found by bench/chaos.py.)
    (tmp / MARKER).write_text(json.dumps({"step": step, "mode": mode}))
    if final.exists():  # the same step saved twice (request right after a periodic save)
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, final)
    files = _files(final)
    return SavedStep(step, final, sum(p.stat().st_size for p in files), time.monotonic() - started, files)


def save_plain(root: Path, step: int, state: dict[str, Any]) -> SavedStep:
    import torch

    started = time.monotonic()
    final = step_dir(root, step)
    if is_complete(final, "state_dict"):
        files = _files(final)
        return SavedStep(step, final, sum(p.stat().st_size for p in files), 0.0, files)
    tmp = root / f".step-{step}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save({"step": step, "state": state}, tmp / PLAIN_FILE)
    return _finish(tmp, final, step, "state_dict", started)


def load_plain(root: Path, step: int) -> dict[str, Any]:
    import torch

    blob = torch.load(step_dir(root, step) / PLAIN_FILE, map_location="cpu", weights_only=False)
    if blob.get("step") != step:
        raise ValueError(f"{step_dir(root, step)} holds step {blob.get('step')}, not {step}")
    state: dict[str, Any] = blob["state"]
    return state


def dcp_tmp_dir(root: Path, step: int) -> Path:
    return root / f".step-{step}.dcp-partial"


def finish_dcp(root: Path, step: int, started: float) -> SavedStep:
    return _finish(dcp_tmp_dir(root, step), step_dir(root, step), step, "dcp", started)


def prune(root: Path, keep: int) -> list[int]:
    """Keep the newest ``keep`` steps; also drop leftovers of interrupted saves."""
    removed = []
    for step in local_steps(root)[keep:]:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
        removed.append(step)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".step-") and ".tmp-" in p.name and not p.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(p, ignore_errors=True)
    return removed
