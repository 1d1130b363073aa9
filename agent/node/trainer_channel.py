"""The agent's end of the local trainer channel: a unix datagram socket at node.trainer_socket.

Keeps the trainer's latest progress (for telemetry) and hands "checkpoint saved" reports to a
callback (the agent publishes them as ``checkpoint-saved`` events). Bad datagrams are logged and
dropped. The sending side is ``fleetd.protocol.trainer.send_report``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from fleetd.protocol.errors import ProtocolError
from fleetd.protocol.trainer import CheckpointSavedLocally, Progress, parse_report
from fleetd.shared.logs import get_logger

log = get_logger(__name__)
# The trainer reports about once a second (agent/trainer/reports.py); a longer gap means it stopped.
DERIVED_RATE_MAX_GAP_S = 5.0

OnCheckpointSaved = Callable[[CheckpointSavedLocally], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class TrainerProgress:
    step: int | None = None
    steps_per_s: float | None = None
    world_size: int | None = None
    reported_at: float | None = None  # monotonic


class TrainerChannel:
    """Receives trainer reports. ``run()`` binds the socket and serves until cancelled."""

    def __init__(
        self,
        socket_path: Path,
        on_checkpoint_saved: OnCheckpointSaved | None = None,
        *,
        stale_after_s: float = 30.0,
    ) -> None:
        self.socket_path = socket_path
        self.on_checkpoint_saved = on_checkpoint_saved
        self.stale_after_s = stale_after_s
        self._progress = TrainerProgress()
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=1000)
        self.rejected = 0

    def progress(self) -> TrainerProgress:
        """Latest progress; empty once the trainer has been silent for ``stale_after_s``."""
        p = self._progress
        if p.reported_at is not None and time.monotonic() - p.reported_at > self.stale_after_s:
            return TrainerProgress()
        return p

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            sock = self._bind()
        except OSError as exc:
            # The notice path matters more than step numbers: keep the agent running without us.
            log.error("trainer_channel_unavailable", socket=str(self.socket_path), error=str(exc))
            return
        transport, _ = await loop.create_datagram_endpoint(lambda: _Receiver(self._queue), sock=sock)
        log.info("trainer_channel_listening", socket=str(self.socket_path))
        try:
            while True:
                await self.handle(await self._queue.get())
        finally:
            transport.close()
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()

    def _bind(self) -> socket.socket:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()  # a stale socket from a previous agent run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(str(self.socket_path))
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        return sock

    async def handle(self, data: bytes) -> None:
        try:
            report = parse_report(data)
        except ProtocolError as exc:
            self.rejected += 1
            log.warning("trainer_report_rejected", error=str(exc), nbytes=len(data))
            return
        if isinstance(report, Progress):
            self._progress = self._merge(report)
        elif isinstance(report, CheckpointSavedLocally):
            log.info("trainer_checkpoint_saved", step=report.step, path=report.path)
            if self.on_checkpoint_saved is not None:
                await self.on_checkpoint_saved(report)

    def _merge(self, report: Progress) -> TrainerProgress:
        now = time.monotonic()
        prev = self._progress
        rate = report.steps_per_s
        # A rate derived across a gap would average in the time no trainer ran (a restarted
        # torchrun's first report after a store outage) and make a healthy node look like a
        # straggler: derive one only between reports close together.
        if (
            rate is None
            and prev.step is not None
            and prev.reported_at is not None
            and report.step >= prev.step
            and now - prev.reported_at <= DERIVED_RATE_MAX_GAP_S
        ):
            elapsed = now - prev.reported_at
            rate = (report.step - prev.step) / elapsed if elapsed > 0 else prev.steps_per_s
        return TrainerProgress(
            step=report.step,
            steps_per_s=rate,
            world_size=report.world_size if report.world_size is not None else prev.world_size,
            reported_at=now,
        )


class _Receiver(asyncio.DatagramProtocol):
    def __init__(self, queue: asyncio.Queue[bytes]) -> None:
        self.queue = queue

    def datagram_received(self, data: bytes, addr: object) -> None:
        try:
            self.queue.put_nowait(data)
        except asyncio.QueueFull:
            pass  # a flood from the trainer: progress is superseded by the next report anyway
