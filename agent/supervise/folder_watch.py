"""Folder mode's one judgement: is what the script wrote in its checkpoint folder complete?

A training script that only saves to a folder tells nobody when a save is done, so the agent
decides from the outside, conservatively. The folder's contents (every file's size and mtime) are
a *version*; a version is complete, and may be uploaded, when

1. it differs from the last version uploaded (or restored),
2. nothing in it changed for ``settle_s`` (size and mtime of every file stable), and
3. no process of the job has any file of it open for writing (``/proc/<pid>/fdinfo`` via psutil).

Condition 3 covers a slow ``torch.save`` straight into the final name (it holds the file open
while writing); condition 2 covers a writer that closes and reopens, and a file renamed into
place (the script's own atomic rename makes the file appear whole at once and is then judged
like any other). Names that are, by convention, still being written are left out of a version:
hidden files (``.snapshot.pt.tmp``) and ``*.tmp``/``*.partial``/``*~``.

The upload then copies the version aside and checks that the folder still matches it before
sending the copy (agent/supervise/folder_sync.py): a script that starts its next save while the
copy is made cannot tear the uploaded version.

``FolderWatch.observe`` is pure (the scan and the open files are passed in, with ``now``), so
the decision is unit-tested without a filesystem.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

Snapshot = Mapping[str, tuple[int, int]]  # relative posix path -> (size, mtime_ns)
_IN_PROGRESS_SUFFIXES = (".tmp", ".partial", "~")
_WRITE_MODES = ("w", "a", "+")


def in_progress_name(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/")) or rel.endswith(_IN_PROGRESS_SUFFIXES)


def scan(root: Path) -> dict[str, tuple[int, int]]:
    """Every finished-looking regular file under ``root`` (relative posix path -> size, mtime)."""
    out: dict[str, tuple[int, int]] = {}
    if not root.is_dir():
        return out
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if in_progress_name(rel):
                continue
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue  # removed while we looked
            if path.is_symlink() or not path.is_file():
                continue
            out[rel] = (st.st_size, st.st_mtime_ns)
    return out


def open_for_writing(pids: Iterable[int], root: Path) -> set[str]:
    """Files under ``root`` (relative names) that one of ``pids`` holds open for writing."""
    base = str(root.resolve()) + os.sep
    out: set[str] = set()
    for pid in pids:
        try:
            files = psutil.Process(pid).open_files()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for f in files:
            mode = getattr(f, "mode", "w")  # unknown mode: assume it writes
            if f.path.startswith(base) and any(m in mode for m in _WRITE_MODES):
                out.add(f.path[len(base) :].replace(os.sep, "/"))
    return out


@dataclass
class FolderWatch:
    settle_s: float = 2.0
    baseline: Snapshot | None = None  # the version last uploaded or restored
    _seen: Snapshot | None = None
    _seen_since: float = 0.0

    def observe(self, snapshot: Snapshot, writing: set[str], now: float) -> Snapshot | None:
        """The version to upload now, if the folder holds a new complete one; else None."""
        snapshot = dict(snapshot)
        if snapshot != self._seen:
            self._seen, self._seen_since = snapshot, now
            return None
        if not snapshot or snapshot == self.baseline:
            return None
        if now - self._seen_since < self.settle_s or writing & set(snapshot):
            return None
        return snapshot

    @property
    def changed_at(self) -> float:
        """When the folder last changed (monotonic, as ``now`` was given)."""
        return self._seen_since

    def uploaded(self, snapshot: Snapshot) -> None:
        self.baseline = dict(snapshot)
