"""Restore the newest complete checkpoint that verifies, into a local directory.

Candidates are every ``step-N/`` under the job prefix plus the step ``latest`` names (listing, not
only ``latest``, so a node killed between writing the manifest and moving ``latest`` loses
nothing). Newest first: a step without a manifest is an upload in progress and is passed over; a
step with a manifest is downloaded (files in parallel, each streamed to disk while it is hashed the way the manifest says)
into ``<dest>/step-N.partial`` and checked file by file against the manifest's size and SHA-256.
Only a fully verified copy is renamed to ``<dest>/step-N``. If a newer checkpoint had to be passed
over because it is corrupt, invalid, or named by ``latest`` but incomplete, one warning line
(``checkpoint_restore_fallback``) says which steps were skipped, why, and which step was used.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from agent.checkpoint_store.errors import CheckpointCorrupt, ObjectNotFound, first_error
from agent.checkpoint_store.publish import Publisher
from agent.checkpoint_store.s3 import S3Bucket
from fleetd.protocol.checkpoints import CheckpointLayout, FileEntry, Manifest
from fleetd.protocol.digests import Checksum, Digest
from fleetd.protocol.errors import ProtocolError
from fleetd.shared.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class RestoredCheckpoint:
    step: int
    directory: Path
    manifest: Manifest
    nbytes: int
    duration_s: float
    # Newer steps passed over, with the reason: [(step, reason), ...]
    skipped: tuple[tuple[int, str], ...] = ()


class _Sink:
    """A file being written and hashed chunk by chunk (called from worker threads, one at a time),
    the way its manifest entry was hashed (Digest: sha256 or sha256-composite)."""

    def __init__(self, path: Path, checksum: Checksum):
        self.digest = Digest.like(checksum)  # ProtocolError for an algorithm we cannot verify
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "wb")
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self._f.write(chunk)
        self.digest.update(chunk)
        self.size += len(chunk)

    def close(self) -> None:
        self._f.close()


class Restorer:
    def __init__(self, bucket: S3Bucket, publisher: Publisher, layout: CheckpointLayout, concurrency: int = 8):
        self._bucket = bucket
        self._publisher = publisher
        self._layout = layout
        self._files = asyncio.Semaphore(concurrency)

    async def candidates(self) -> tuple[list[int], int | None]:
        steps = set((await self._publisher.steps()).keys())
        latest_step = None
        try:
            latest, _ = await self._publisher.read_latest()
            latest_step = latest.step if latest else None
        except ProtocolError as exc:
            log.warning("latest_pointer_rejected", error=str(exc))
        if latest_step is not None:
            steps.add(latest_step)
        return sorted(steps, reverse=True), latest_step

    async def restore_latest(self, dest_dir: Path) -> RestoredCheckpoint | None:
        steps, latest_step = await self.candidates()
        skipped: list[tuple[int, str]] = []
        for step in steps:
            try:
                manifest = await self._publisher.read_manifest(step)
            except ProtocolError as exc:
                skipped.append((step, f"invalid manifest: {exc}"))
                continue
            if manifest is None:
                if step == latest_step:
                    skipped.append((step, "named by latest but has no manifest"))
                continue  # an upload still in progress (or abandoned): never trusted
            try:
                restored = await self.restore_step(manifest, dest_dir)
            except CheckpointCorrupt as exc:
                skipped.append((step, str(exc)))
                continue
            if skipped:
                log.warning(
                    "checkpoint_restore_fallback",
                    restored_step=step,
                    skipped=[{"step": s, "reason": r} for s, r in skipped],
                )
            return RestoredCheckpoint(
                restored.step,
                restored.directory,
                restored.manifest,
                restored.nbytes,
                restored.duration_s,
                tuple(skipped),
            )
        if skipped:
            log.error("checkpoint_restore_none_valid", skipped=[{"step": s, "reason": r} for s, r in skipped])
        return None

    async def restore_step(self, manifest: Manifest, dest_dir: Path) -> RestoredCheckpoint:
        """Download and verify every file of ``manifest``; CheckpointCorrupt if any is wrong."""
        started = time.monotonic()
        final = dest_dir / f"step-{manifest.step}"
        partial = dest_dir / f"step-{manifest.step}.partial"
        await asyncio.to_thread(shutil.rmtree, partial, True)
        try:
            try:
                async with asyncio.TaskGroup() as tg:
                    for entry in manifest.files:
                        tg.create_task(self._fetch(manifest.step, entry, partial))
            except BaseExceptionGroup as eg:
                raise first_error(eg) from eg
            await asyncio.to_thread(_replace_dir, partial, final)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, partial, True)
            raise
        duration = time.monotonic() - started
        log.info(
            "checkpoint_restored",
            step=manifest.step,
            files=len(manifest.files),
            nbytes=manifest.total_bytes,
            duration_s=round(duration, 3),
            directory=str(final),
        )
        return RestoredCheckpoint(manifest.step, final, manifest, manifest.total_bytes, duration)

    async def _fetch(self, step: int, entry: FileEntry, into: Path) -> None:
        key = self._layout.file_key(step, entry.name)
        async with self._files:
            try:
                sink = await asyncio.to_thread(_Sink, into / entry.name, entry.checksum)
            except ProtocolError as exc:
                raise CheckpointCorrupt(f"step {step}: {entry.name}: {exc}") from None
            try:
                async with self._bucket.stream(key) as chunks:
                    async for chunk in chunks:
                        await asyncio.to_thread(sink.write, chunk)
                        if sink.size > entry.size:
                            break
            except ObjectNotFound:
                raise CheckpointCorrupt(f"step {step}: {entry.name} is missing from S3") from None
            finally:
                await asyncio.to_thread(sink.close)
        if sink.size != entry.size:
            raise CheckpointCorrupt(f"step {step}: {entry.name} has {sink.size} bytes, manifest says {entry.size}")
        if sink.digest.checksum() != entry.checksum:
            raise CheckpointCorrupt(
                f"step {step}: {entry.name} {entry.checksum.algorithm} mismatch (bytes changed after upload)"
            )


def _replace_dir(src: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    src.rename(dst)
