"""Folder mode's one judgement: is what the script wrote in its checkpoint folder complete?

The folder's files (each one's size and mtime; hidden and ``*.tmp``/``*.partial``/``*~`` names left
out) are a *version*. It is complete when it differs from the last one uploaded or restored,
nothing in it changed for ``settle_s``, and no process of the job has any of it open for writing.
``FolderWatch.observe`` is pure: the scan, the open files and ``now`` are passed in.
(docs/DESIGN.md "Training loops and what each guarantees")
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
        # Open for writing: a slow torch.save straight into the final name. Settling: a writer that
        # closes and reopens. A file renamed into place appears whole and is judged like any other.
        if now - self._seen_since < self.settle_s or writing & set(snapshot):
            return None
        return snapshot

    @property
    def changed_at(self) -> float:
        """When the folder last changed (monotonic, as ``now`` was given)."""
        return self._seen_since

    def uploaded(self, snapshot: Snapshot) -> None:
        self.baseline = dict(snapshot)
