"""Reading the control host's copy of a job's logs (fleetd/joblogs/layout.py) as it grows: the
first ``poll`` returns every stored line of every node (rotated files first), each later one only
what was appended since, across a rotation too. ``fleetd logs`` prints what it returns."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from fleetd.joblogs.layout import StoredLine, node_file, node_files, parse_line, rotated


@dataclass(frozen=True, slots=True)
class NodeLine:
    node: str
    line: StoredLine


@dataclass
class _Cursor:
    inode: int
    offset: int


def _read(path: Path, offset: int) -> tuple[list[str], int]:
    """Complete lines from ``offset`` on, and the offset after the last one (a line still being
    written is left for the next read)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    return data[:end].decode(errors="replace").splitlines(), offset + end


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


@dataclass
class LogFollower:
    state_dir: Path
    job: str
    node: str | None = None  # only this node's lines
    _cursors: dict[str, _Cursor] = field(default_factory=dict)

    def poll(self) -> list[NodeLine]:
        """New lines of every node (of ``node`` only when set), interleaved by time; within a
        node they keep their order."""
        out: list[NodeLine] = []
        for node, paths in node_files(self.state_dir, self.job).items():
            if self.node is not None and node != self.node:
                continue
            raw = self._new_lines(node, paths)
            out += [NodeLine(node, parsed) for text in raw if (parsed := parse_line(text)) is not None]
        out.sort(key=lambda n: n.line.at)  # stable: a node's lines of one batch stay in order
        return out

    def _new_lines(self, node: str, paths: list[Path]) -> list[str]:
        current = node_file(self.state_dir, self.job, node)
        cursor = self._cursors.get(node)
        lines: list[str] = []
        if cursor is None:  # first sight: every file, oldest first
            for path in paths[:-1]:
                lines += _read(path, 0)[0]
            inode = _inode(current)
            if inode is None:
                return lines
            more, offset = _read(current, 0)
            self._cursors[node] = _Cursor(inode, offset)
            return lines + more
        inode = _inode(current)
        if inode is None:
            return lines
        if inode != cursor.inode:
            # Rotated since the last poll: the rest of the file we were reading is now .log.1.
            older = rotated(current, 1)
            if _inode(older) == cursor.inode:
                lines += _read(older, cursor.offset)[0]
            cursor.inode, cursor.offset = inode, 0
        more, cursor.offset = _read(current, cursor.offset)
        return lines + more
