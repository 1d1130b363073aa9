"""torchrun's output (its own, its warm pool's and its workers', which inherit it) read from a pipe
by a thread of the agent, line by line.

Each chunk goes byte for byte to the node's bounded ``torchrun.log``, which the agent's readers
scan as it grows; each complete line goes to the ``WorkerLogSink`` (journald, the batcher). Nothing
here may stall the workers: a pipe nobody drains fills at 64 KiB and every rank's print blocks, so
a sink that raises is dropped and the reading goes on. (docs/DESIGN.md "Wire protocol (MQTT)")
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from pathlib import Path
from typing import BinaryIO

from agent.node.log_sink import WorkerLogSink
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

MAX_BYTES = 32 * 1024 * 1024
READ_BYTES = 64 * 1024
MAX_LINE_CHARS = 8000  # a line longer than this is shipped cut (the file keeps it whole)
# torchrun's --tee prefix: fleetd's "[3]:" (the global rank, launch.RANK_PREFIX_TEMPLATE) or
# torch's default "[default0]:" (role and local rank); and torch's own "[rank0]:" on a distributed
# error: the first one on a line names the rank that wrote it.
RANK_PREFIX = re.compile(r"^\[[A-Za-z_]*?(\d{1,5})\]:")
TEE_PREFIX = re.compile(r"^\[(\d{1,5})\]:")


def rank_of(line: str) -> int | None:
    m = RANK_PREFIX.match(line)
    return int(m.group(1)) if m else None


def split_rank(line: str) -> tuple[int | None, str]:
    """The line's rank and its text without torchrun's tee prefix (journald and the control host
    carry the rank as a field: the text is what the worker wrote)."""
    m = TEE_PREFIX.match(line)
    if m:
        return int(m.group(1)), line[m.end() :]
    return rank_of(line), line


class RotatingFile:
    """Append-only, renamed to ``<name>.1`` once ``max_bytes`` would be passed (the one before is
    dropped). Its readers (failure_guard.py, store_watch.log_tail) then start again from the top
    of a file shorter than where they were."""

    def __init__(self, path: Path, max_bytes: int = MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f: BinaryIO = open(path, "ab", buffering=0)  # noqa: SIM115 - closed by close()

    def write(self, data: bytes) -> None:
        if self._f.tell() + len(data) > self.max_bytes and self._f.tell() > 0:
            self._f.close()
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            self._f = open(self.path, "ab", buffering=0)  # noqa: SIM115
        self._f.write(data)

    def close(self) -> None:
        self._f.close()


class WorkerOutput:
    """One pipe for one torchrun (and its warm pool): ``writer()`` is the fd its children get as
    stdout and stderr; ``close_writer()`` once they are started, so the reader sees EOF when the
    last of them exits; ``join()`` waits until everything they wrote is in the file."""

    def __init__(self, path: Path | None, sink: WorkerLogSink | None = None, max_bytes: int = MAX_BYTES) -> None:
        self.path = path
        self.sink = sink
        self.max_bytes = max_bytes
        self.lines = 0
        self._wfd: int | None = None  # the parent's copy of the write end, until close_writer
        self._closed = False
        self._thread: threading.Thread | None = None

    def writer(self) -> int:
        if self._closed:
            raise RuntimeError("this torchrun's output pipe was closed: start a new TorchrunProcess")
        if self._wfd is None:
            file = RotatingFile(self.path, self.max_bytes) if self.path is not None else None
            rfd, self._wfd = os.pipe()
            self._thread = threading.Thread(target=self._pump, args=(rfd, file), name="worker-output", daemon=True)
            self._thread.start()
        return self._wfd

    def close_writer(self) -> None:
        self._closed = True
        if self._wfd is not None:
            os.close(self._wfd)
            self._wfd = None

    def join(self, timeout_s: float = 5.0) -> bool:
        """True once the reader has read to EOF (every writer gone) and written it all."""
        self.close_writer()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _pump(self, rfd: int, file: RotatingFile | None) -> None:
        rest = b""
        try:
            while chunk := os.read(rfd, READ_BYTES):
                if file is not None:
                    try:
                        file.write(chunk)
                    except OSError as exc:  # a full disk: keep draining the pipe, into the sinks only
                        log.error("worker_output_file_failed", path=str(self.path), error=str(exc))
                        with contextlib.suppress(OSError):
                            file.close()
                        file = None
                *complete, rest = (rest + chunk).split(b"\n")
                for raw in complete:
                    self._line(raw)
                if len(rest) > 4 * MAX_LINE_CHARS:  # no newline for a long while: ship it cut
                    self._line(rest)
                    rest = b""
            if rest:
                self._line(rest)
        except OSError as exc:
            log.warning("worker_output_read_failed", error=str(exc))
        finally:
            os.close(rfd)
            if file is not None:
                with contextlib.suppress(OSError):
                    file.close()

    def _line(self, raw: bytes) -> None:
        self.lines += 1
        if self.sink is None:
            return
        text = raw.decode(errors="replace").rstrip("\r")[:MAX_LINE_CHARS]
        try:
            rank, text = split_rank(text)
            self.sink.line(text, rank)
        except Exception:  # noqa: BLE001 - the workers' pipe must keep draining whatever a sink does
            log.exception("worker_output_sink_failed", why="lines go to the node's file only from now on")
            self.sink = None
