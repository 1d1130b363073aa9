"""Upload one writer's shard files of a step: multipart, parallel, checksummed, cleaned up.

Parts of every file share ``concurrency`` slots, the urgent step's first. Each part is read once,
in the uploader's own threads, and hashed there: CRC32 for S3, SHA-256 for the manifest. A file
that changes while it is uploaded fails the upload; a failed or abandoned multipart upload is
aborted. (docs/DESIGN.md "Durable checkpoints")
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import math
import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from agent.checkpoint_store.errors import ObjectNotFound, StoreError, first_error
from agent.checkpoint_store.ledger import UploadLedger
from agent.checkpoint_store.s3 import CompletedPart, S3Bucket
from agent.checkpoint_store.slots import PrioritySlots
from fleetd.protocol.checkpoints import CheckpointLayout, FileEntry
from fleetd.protocol.digests import Checksum
from fleetd.shared.logs import get_logger
from fleetd.shared.waits import within

log = get_logger(__name__)

_T = TypeVar("_T")

MiB = 1 << 20
S3_MIN_PART = 5 * MiB
S3_MAX_PARTS = 10_000


@dataclass(frozen=True, slots=True)
class UploadTuning:
    concurrency: int = 8
    # None: choose per file (choose_part_size). A fixed size must be >= 5 MiB (S3's minimum).
    part_size: int | None = None
    # 8 MiB: AWS recommends 8-16 MiB; against moto 16 MiB parts cost ~15 % more CPU per GiB and
    # 32-64 MiB parts were 1.5-2x slower end to end. Throughput comes from parts in flight, not size.
    min_part_size: int = 8 * MiB
    max_part_size: int = 8 * MiB
    # Multipart uploads under the job prefix for an older step than the one being written, started
    # longer ago than this, belong to nobody alive and are aborted.
    stale_upload_after_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.part_size is not None and self.part_size < S3_MIN_PART:
            raise ValueError("part_size must be >= 5 MiB (S3's minimum part size)")


def choose_part_size(size: int, tuning: UploadTuning) -> int:
    if tuning.part_size is not None:
        return max(tuning.part_size, math.ceil(size / S3_MAX_PARTS))
    target = math.ceil(size / (2 * tuning.concurrency))
    part = min(max(target, tuning.min_part_size), tuning.max_part_size)
    part = max(part, math.ceil(size / S3_MAX_PARTS), S3_MIN_PART)
    return math.ceil(part / MiB) * MiB


def _read_part(path: Path, offset: int, length: int) -> tuple[io.BytesIO, bytes, str]:
    """The part as a BytesIO, read in place, its SHA-256 (for the manifest) and its CRC32 as S3
    wants it (base64 of the big-endian 4 bytes). A worker thread runs this.

    Why a BytesIO filled through its own buffer: botocore turns ``bytes`` bodies into a BytesIO
    whose buffer it shares, and aiohttp's getbuffer() on that copies the whole part on the event
    loop; a ``bytearray`` body is worse on Python < 3.12.9 (aiohttp joins it with the headers and
    slices it: two full copies on the loop). A BytesIO that owns its buffer is streamed in 256 KiB
    reads with no big copy, and the one copy from the page cache happens here, off the loop."""
    body = io.BytesIO()
    if length:
        body.seek(length - 1)
        body.write(b"\0")  # sizes the BytesIO's own buffer in place: no n-byte temporary
    with body.getbuffer() as view, open(path, "rb") as f:
        f.seek(offset)
        got = f.readinto(view)
        if got != length:
            raise StoreError(f"{path}: file shrank during upload (wanted {length} bytes at {offset})")
        digest = hashlib.sha256(view).digest()
        crc = base64.b64encode(zlib.crc32(view).to_bytes(4, "big")).decode()
    body.seek(0)
    return body, digest, crc


def _fingerprint(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


class Uploader:
    def __init__(
        self,
        bucket: S3Bucket,
        layout: CheckpointLayout,
        ledger: UploadLedger,
        tuning: UploadTuning = UploadTuning(),
    ):
        self._bucket = bucket
        self._layout = layout
        self._ledger = ledger
        self.tuning = tuning
        # One pool for every part of every step: memory stays within concurrency × part size, and
        # after a notice the urgent, newest step's parts overtake older ones.
        self._slots = PrioritySlots(tuning.concurrency)
        # Own threads for reading and hashing parts: the default executor has only cpu+4 workers,
        # and part reads must not queue behind unrelated to_thread work elsewhere in the agent.
        self._pool = ThreadPoolExecutor(tuning.concurrency, thread_name_prefix="ckpt-upload")
        # Upload ids this process is working on, and keys whose CreateMultipartUpload is in flight
        # (its id is not known yet): stale-upload cleanup must never touch either.
        self._active: set[str] = set()
        self._creating: set[str] = set()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def _in_pool(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def upload_files(self, step: int, files: list[tuple[str, Path]], prio: tuple[int, int]) -> list[FileEntry]:
        """Upload (name, local path) pairs to step-N/<name>; the FileEntry of each, same order."""
        results: list[FileEntry | None] = [None] * len(files)

        async def one(i: int, name: str, path: Path) -> None:
            results[i] = await self._upload_file(step, name, path, prio)

        try:
            async with asyncio.TaskGroup() as tg:
                for i, (name, path) in enumerate(files):
                    tg.create_task(one(i, name, path))
        except BaseExceptionGroup as eg:
            raise first_error(eg) from eg
        return [r for r in results if r is not None]

    async def _upload_file(self, step: int, name: str, path: Path, prio: tuple[int, int]) -> FileEntry:
        key = self._layout.file_key(step, name)
        before = await asyncio.to_thread(_fingerprint, path)
        size = before[0]
        part_size = choose_part_size(size, self.tuning)
        if size <= part_size:
            async with self._slots.slot(prio):
                data, digest, _ = await self._in_pool(_read_part, path, 0, size)
                await self._bucket.put_bytes(key, data, sha256_b64=base64.b64encode(digest).decode())
            checksum = Checksum.sha256(digest)
        else:
            checksum = await self._multipart(key, path, size, part_size, prio)
        # The trainer writes a new directory per step; a change here would publish a checksum of
        # other bytes.
        if await asyncio.to_thread(_fingerprint, path) != before:
            raise StoreError(f"{path} changed while it was uploaded; not publishing it")
        return FileEntry(name=name, size=size, checksum=checksum)

    async def _multipart(self, key: str, path: Path, size: int, part_size: int, prio: tuple[int, int]) -> Checksum:
        self._creating.add(key)
        try:
            upload_id = await self._bucket.create_multipart(key)
        finally:
            self._creating.discard(key)
        self._active.add(upload_id)
        try:
            await asyncio.to_thread(self._ledger.record, key, upload_id)
            n_parts = math.ceil(size / part_size)
            parts: list[CompletedPart] = []
            digests: dict[int, bytes] = {}

            async def send(number: int) -> None:
                offset = (number - 1) * part_size
                length = min(part_size, size - offset)
                async with self._slots.slot(prio):
                    # CRC32: S3 rejects a part corrupted on the wire. SHA-256s: the manifest's
                    # sha256-composite, the end-to-end check restore verifies.
                    data, digests[number], crc = await self._in_pool(_read_part, path, offset, length)
                    parts.append(await self._bucket.upload_part(key, upload_id, number, data, crc))

            try:
                async with asyncio.TaskGroup() as tg:
                    for number in range(1, n_parts + 1):
                        tg.create_task(send(number))
            except BaseExceptionGroup as eg:
                raise first_error(eg) from eg
            await self._bucket.complete_multipart(key, upload_id, parts)
        except BaseException:
            # Failed or cancelled: don't leave billed parts behind. Shielded and bounded so a
            # cancellation still propagates promptly; the ledger covers us if this abort fails.
            await self._abort_quietly(key, upload_id)
            raise
        finally:
            self._active.discard(upload_id)
        await asyncio.to_thread(self._ledger.forget, upload_id)
        log.debug("multipart_complete", key=key, parts=n_parts, part_size=part_size)
        return Checksum.sha256_composite((digests[n] for n in range(1, n_parts + 1)), part_size)

    async def _abort_quietly(self, key: str, upload_id: str) -> None:
        async def abort() -> None:
            try:
                await self._bucket.abort_multipart(key, upload_id)
            except ObjectNotFound:
                pass
            await asyncio.to_thread(self._ledger.forget, upload_id)

        # If we are cancelled again while aborting, the shielded abort finishes in the background.
        task = asyncio.ensure_future(abort())
        try:
            await within(asyncio.shield(task), 10)
        except (StoreError, TimeoutError) as exc:
            log.warning("multipart_abort_failed", key=key, upload_id=upload_id, error=str(exc))

    async def abort_stale_uploads(self, current_step: int, now: datetime | None = None) -> int:
        """Abort multipart uploads under the job prefix that nobody will complete: this writer's own
        from an earlier run (the ledger), and any for an older step that are older than
        ``stale_upload_after_s``. Uploads this process has in flight are never touched, so this
        can run alongside them."""
        now = now or datetime.now(UTC)
        # Entries of a live process (an operator's upload next to the agent) are not ours to abort.
        own = {e.upload_id: e for e in await asyncio.to_thread(self._ledger.entries) if not e.owner_alive()}
        cutoff = now - timedelta(seconds=self.tuning.stale_upload_after_s)
        aborted = 0
        for u in await self._bucket.list_multipart_uploads(self._layout.job_prefix):
            if u.upload_id in self._active:
                continue
            step = self._layout.step_of_key(u.key)
            initiated = u.initiated.astimezone(UTC) if u.initiated else None
            orphaned = (
                step is not None
                and step < current_step
                and initiated is not None
                and initiated < cutoff
                # an upload of ours whose CreateMultipartUpload has not returned yet looks the same
                and u.key not in self._creating
            )
            # (A ledger entry is written only after its upload id is in _active, so `own` never
            # holds an upload this process is still working on.)
            if u.upload_id not in own and not orphaned:
                continue
            try:
                await self._bucket.abort_multipart(u.key, u.upload_id)
            except ObjectNotFound:
                pass
            aborted += 1
            log.info(
                "stale_multipart_aborted",
                key=u.key,
                upload_id=u.upload_id,
                reason="own upload from an earlier run" if u.upload_id in own else "orphaned",
            )
        # Ledger entries whose upload no longer exists (completed or aborted elsewhere) are dropped.
        for upload_id in own:
            if upload_id not in self._active:
                await asyncio.to_thread(self._ledger.forget, upload_id)
        return aborted
