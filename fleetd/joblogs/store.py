"""The controller's side of the ``logs`` channel: batches of the workers' output appended to
``<state_dir>/logs/<job>/<instance-id>.log`` (fleetd/joblogs/layout.py), bounded by rotation.

``accept`` runs on the event loop, called by the MQTT intake for each validated ``WorkerLogs``: it
drops a batch already written (the same stream and sequence number: a resend), notes lines that
went missing between batches, and queues the batch. ``run`` writes the queue in order, each batch
in a worker thread (``asyncio.to_thread``): file I/O never runs on the loop the planner and the
intake share. The queue is bounded; a controller that cannot keep up drops batches and says so in
its own log, it never slows the intake (a notice may be next in line).
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import Counter

from fleetd.joblogs.layout import KEEP, MAX_BYTES, format_line, node_file, rotated
from fleetd.protocol.messages import WorkerLogs
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

QUEUE_BATCHES = 1024
SEEN_PER_STREAM = 4096  # sequence numbers remembered per stream (a resend comes soon or not at all)
STREAMS = 4096  # streams remembered (one per agent run); the oldest is forgotten first

LOG_BATCHES = Counter("fleetd_worker_log_batches_total", "Worker log batches by result", ["result"])
_WRITTEN, _DUPLICATE, _OVERFLOW = (LOG_BATCHES.labels(r) for r in ("written", "duplicate", "overflow"))


@dataclass
class _Stream:
    seen: OrderedDict[int, None] = field(default_factory=OrderedDict)
    next_line: int | None = None  # the line offset the next batch should start at


def append_batch(state_dir: Path, batch: WorkerLogs, lost: int, max_bytes: int = MAX_BYTES, keep: int = KEEP) -> None:
    """Append one batch to its node's file, rotating first when it would pass ``max_bytes``.
    Blocking: called in a worker thread."""
    path = node_file(state_dir, batch.job, batch.instance_id)
    text = "".join(_lines(batch, lost)).encode(errors="replace")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        size = 0
    if size and size + len(text) > max_bytes:
        for n in range(keep, 0, -1):  # .log.N-1 -> .log.N ...; the oldest is overwritten
            older = rotated(path, n - 1) if n > 1 else path
            if older.exists():
                os.replace(older, rotated(path, n))
    with open(path, "ab") as f:
        f.write(text)


def _lines(batch: WorkerLogs, lost: int) -> list[str]:
    out = []
    if lost:
        out.append(format_line(batch.sent_at, None, f"[fleetd: {lost} lines lost on the way here]"))
    if batch.dropped:
        out.append(
            format_line(
                batch.sent_at,
                None,
                f"[fleetd: {batch.dropped} lines dropped on the node (rate cap); its journal has them]",
            )
        )
    out += [format_line(batch.sent_at, line.rank, line.text) for line in batch.lines]
    return out


@dataclass
class WorkerLogStore:
    state_dir: Path
    # The fleet's job: a batch naming another is refused (a node may not make folders at will).
    job: str | None = None
    max_bytes: int = MAX_BYTES
    keep: int = KEEP
    queue_batches: int = QUEUE_BATCHES
    written: int = 0
    duplicates: int = 0
    overflows: int = 0
    refused: int = 0
    _streams: OrderedDict[tuple[str, str], _Stream] = field(default_factory=OrderedDict)
    _queue: asyncio.Queue[tuple[WorkerLogs, int]] | None = None

    def _q(self) -> asyncio.Queue[tuple[WorkerLogs, int]]:
        if self._queue is None:
            self._queue = asyncio.Queue(self.queue_batches)
        return self._queue

    def accept(self, batch: WorkerLogs) -> bool:
        """Queue a batch for writing; False when it was refused, a duplicate, or the queue is full."""
        if self.job is not None and batch.job != self.job:
            self.refused += 1
            log.warning(
                "worker_logs_refused", instance_id=batch.instance_id, job=batch.job, why=f"this fleet runs {self.job!r}"
            )
            return False
        key = (batch.instance_id, batch.stream)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = _Stream()
            if len(self._streams) > STREAMS:
                self._streams.popitem(last=False)
        else:
            self._streams.move_to_end(key)
        if batch.seq in stream.seen:
            self.duplicates += 1
            _DUPLICATE.inc()
            return False
        # Lines between the last batch and this one that neither arrived nor were dropped on the
        # node: a batch lost on the way (QoS 0), said in the file where they would have been.
        lost = 0
        if stream.next_line is not None:
            lost = max(0, batch.first_line - batch.dropped - stream.next_line)
        try:
            self._q().put_nowait((batch, lost))
        except asyncio.QueueFull:
            self.overflows += 1
            _OVERFLOW.inc()
            log.warning("worker_logs_overflow", instance_id=batch.instance_id, seq=batch.seq, lines=len(batch.lines))
            return False
        stream.seen[batch.seq] = None
        if len(stream.seen) > SEEN_PER_STREAM:
            stream.seen.popitem(last=False)
        stream.next_line = max(stream.next_line or 0, batch.first_line + len(batch.lines))
        return True

    async def run(self) -> None:
        """Write queued batches, in order, off the event loop, for the life of the daemon."""
        queue = self._q()
        while True:
            batch, lost = await queue.get()
            try:
                await asyncio.to_thread(append_batch, self.state_dir, batch, lost, self.max_bytes, self.keep)
            except OSError as exc:
                log.error("worker_logs_write_failed", instance_id=batch.instance_id, job=batch.job, error=str(exc))
            else:
                self.written += 1
                _WRITTEN.inc()
            finally:
                queue.task_done()

    async def drain(self) -> None:
        """Wait until everything queued so far is written (tests; a clean stop)."""
        await self._q().join()
