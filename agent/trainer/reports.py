"""What a training rank tells the outside world: a JSON-lines events file (tests and benchmarks
read it) and the agent's trainer channel (checkpoints saved locally, progress)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from agent.trainer.context import TrainerContext
from agent.trainer.local_ckpt import SavedStep

PROGRESS_EVERY_S = 1.0  # the agent's telemetry is ~1 Hz: more often only adds datagrams


class TrainerReports:
    def __init__(self, ctx: TrainerContext) -> None:
        self.ctx = ctx
        self._progress_at = time.monotonic()
        self._progress_step: int | None = None

    def emit(self, event: str, **fields: Any) -> None:
        """Append one JSON line to the events file; a cheap no-op without one."""
        if self.ctx.events_file is None:
            return
        rec = {
            "ev": event,
            "t": time.time(),
            "rank": self.ctx.rank,
            "world": self.ctx.world_size,
            "node": self.ctx.node_addr,
            "pid": os.getpid(),
            **fields,
        }
        line = (json.dumps(rec) + "\n").encode()
        fd = os.open(self.ctx.events_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def saved(self, saved: SavedStep) -> None:
        """Tell the agent a step is on the local disk (it uploads it)."""
        if self.ctx.trainer_socket is None:
            return
        from fleetd.protocol.trainer import CheckpointSavedLocally, send_report

        send_report(
            self.ctx.trainer_socket,
            CheckpointSavedLocally(
                rank=self.ctx.rank,
                step=saved.step,
                world_size=self.ctx.world_size,
                path=str(saved.directory),
                nbytes=saved.nbytes,
                duration_s=saved.duration_s,
            ),
        )

    def progress(self, step: int) -> None:
        """Step and rate, from each node's local rank 0, at most every ``PROGRESS_EVERY_S``."""
        if self.ctx.trainer_socket is None or self.ctx.local_rank != 0:
            return
        now = time.monotonic()
        if self._progress_step is not None and now - self._progress_at < PROGRESS_EVERY_S:
            return
        rate = None
        if self._progress_step is not None and now > self._progress_at:
            rate = max(0.0, (step - self._progress_step) / (now - self._progress_at))
        self._progress_at, self._progress_step = now, step
        from fleetd.protocol.trainer import Progress, send_report

        send_report(
            self.ctx.trainer_socket,
            Progress(rank=self.ctx.rank, step=step, steps_per_s=rate, world_size=self.ctx.world_size),
        )
