"""CheckpointStore: the one object the agent and the training-side helper use.

    async with CheckpointStore.connect(cfg.checkpoints, cfg.aws, job="train") as store:
        result = await store.upload_step(step, files, writer=instance_id,
                                         expected_writers=[...], deadline=notice_deadline)
        restored = await store.restore_latest(dest_dir)     # RestoredCheckpoint | None

``upload_step`` uploads this node's files of step N, confirms them with a receipt, and publishes
the manifest + ``latest`` if it is the node that completes the set (publish.py; docs/DESIGN.md
"Durable checkpoints"), then applies retention. ``result.complete`` says whether step N is durable
now; a node whose peers are still uploading can ``await store.wait_complete(step, timeout_s)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from botocore.config import Config

from agent.checkpoint_store.errors import StoreError, first_error
from agent.checkpoint_store.ledger import UploadLedger
from agent.checkpoint_store.publish import Publisher
from agent.checkpoint_store.restore import RestoredCheckpoint, Restorer
from agent.checkpoint_store.s3 import S3Bucket
from agent.checkpoint_store.slots import priority
from agent.checkpoint_store.uploader import Uploader, UploadTuning
from fleetd.protocol.checkpoints import CheckpointLayout, FileEntry, Manifest, WriterReceipt, validate_file_name
from fleetd.protocol.errors import ProtocolError
from fleetd.protocol.messages import CheckpointUploaded
from fleetd.shared.logs import get_logger
from fleetd.shared.settings import AwsConfig, CheckpointConfig

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class UploadResult:
    step: int
    writer: str
    files: tuple[FileEntry, ...]
    nbytes: int
    duration_s: float
    # This node's shards are in S3 and confirmed by its receipt (the node is safe to lose).
    shard_done_at: datetime
    # Step N's manifest exists (every expected writer's shards are in): the step is durable.
    complete: bool
    # This node's merge won the conditional create of MANIFEST.json.
    published: bool
    latest_step: int | None
    deleted_steps: tuple[int, ...]
    # None without a deadline; else whether this node's shards were confirmed before it.
    beat_deadline: bool | None
    s3_prefix: str

    def to_event(self, instance_id: str) -> CheckpointUploaded:
        return CheckpointUploaded(
            instance_id=instance_id,
            step=self.step,
            files=len(self.files),
            nbytes=self.nbytes,
            s3_prefix=self.s3_prefix,
            duration_s=self.duration_s,
            beat_deadline=self.beat_deadline,
            complete=self.complete,
        )


def _utcnow() -> datetime:
    return datetime.now(UTC)


class CheckpointStore:
    def __init__(
        self,
        bucket: S3Bucket,
        *,
        prefix: str,
        job: str,
        keep: int,
        state_dir: Path,
        tuning: UploadTuning | None = None,
        clock: Callable[[], datetime] = _utcnow,
    ):
        tuning = tuning or UploadTuning()
        self.bucket = bucket
        self.layout = CheckpointLayout(prefix, job)
        self.keep = keep
        self._clock = clock
        self.uploader = Uploader(bucket, self.layout, UploadLedger(state_dir / "multipart"), tuning)
        self.publisher = Publisher(bucket, self.layout)
        self.restorer = Restorer(bucket, self.publisher, self.layout, tuning.concurrency)

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls,
        checkpoints: CheckpointConfig,
        aws: AwsConfig,
        *,
        job: str,
        tuning: UploadTuning | None = None,
        state_dir: Path | None = None,
        client_config: Config | None = None,
        clock: Callable[[], datetime] = _utcnow,
    ) -> AsyncIterator[CheckpointStore]:
        """``state_dir`` (default ``<local_dir>/.store``) holds the open-uploads ledger; it must
        survive agent restarts on the node. ``client_config``: botocore retries/timeouts."""
        tuning = tuning or UploadTuning(
            concurrency=checkpoints.upload_concurrency,
            part_size=checkpoints.part_size_mb * (1 << 20) if checkpoints.part_size_mb else None,
        )
        async with S3Bucket.connect(
            checkpoints.bucket,
            region=aws.region,
            endpoint_url=aws.endpoint_url,
            profile=aws.profile,
            max_connections=tuning.concurrency + 4,
            config=client_config,
        ) as bucket:
            store = cls(
                bucket,
                prefix=checkpoints.prefix,
                job=job,
                keep=checkpoints.keep,
                state_dir=state_dir or checkpoints.local_dir / ".store",
                tuning=tuning,
                clock=clock,
            )
            try:
                yield store
            finally:
                await asyncio.to_thread(store.uploader.close)

    async def ensure_bucket(self) -> None:
        await self.bucket.ensure_bucket()

    async def upload_step(
        self,
        step: int,
        files: Sequence[Path],
        *,
        writer: str,
        expected_writers: Collection[str] | None = None,
        world_size: int | None = None,
        deadline: datetime | None = None,
        root: Path | None = None,
        step_files: Sequence[str] | None = None,
    ) -> UploadResult:
        """Upload this writer's ``files`` of ``step`` (named relative to ``root``, else by file
        name) and publish the step if this writer completes it. ``expected_writers``: every node
        that contributes files to this step (default: only this one). ``deadline``: the notice's
        termination time; its presence puts this upload ahead of all others. ``step_files``:
        sharded state, every file of the step across nodes (from its metadata; see
        local_ckpt.upload_set), which completes the step whoever wrote the parts."""
        started = time.monotonic()
        writers = tuple(sorted(set(expected_writers or (writer,))))
        named = self._named_files(step, files, writer, writers, root)
        entries = await self._upload_files(step, named, deadline)
        receipt = WriterReceipt(
            job=self.layout.job,
            step=step,
            writer=writer,
            world_size=world_size or len(writers),
            expected_writers=writers,
            files=tuple(entries),
            step_files=tuple(step_files) if step_files is not None else None,
        )
        await self.publisher.write_receipt(receipt)
        shard_done_at = self._clock()

        manifest, latest_step, deleted = await self._publish(receipt)
        published = manifest is not None and manifest.writer == writer
        result = UploadResult(
            step=step,
            writer=writer,
            files=tuple(entries),
            nbytes=sum(e.size for e in entries),
            duration_s=time.monotonic() - started,
            shard_done_at=shard_done_at,
            complete=manifest is not None,
            published=published,
            latest_step=latest_step,
            deleted_steps=tuple(deleted),
            beat_deadline=None if deadline is None else shard_done_at <= deadline,
            s3_prefix=f"s3://{self.bucket.bucket}/{self.layout.step_prefix(step)}",
        )
        log.info(
            "checkpoint_uploaded",
            step=step,
            writer=writer,
            files=len(entries),
            nbytes=result.nbytes,
            duration_s=round(result.duration_s, 3),
            mb_s=round(result.nbytes / (1 << 20) / max(result.duration_s, 1e-9), 1),
            complete=result.complete,
            published=published,
            beat_deadline=result.beat_deadline,
        )
        if deadline is not None and not result.beat_deadline:
            log.warning("checkpoint_missed_deadline", step=step, deadline=deadline.isoformat())
        return result

    def _named_files(
        self, step: int, files: Sequence[Path], writer: str, writers: tuple[str, ...], root: Path | None
    ) -> list[tuple[str, Path]]:
        """Each file with its name in the step; ValueError for anything S3 keys cannot carry."""
        if writer not in writers:
            raise ValueError(f"writer {writer!r} is not among expected_writers {writers}")
        for w in writers:
            self.layout.receipt_key(step, w)  # ValueError now for a name S3 keys can't carry
        named = [(self._name(p, root), p) for p in files]
        if not named:
            raise ValueError("upload_step needs at least one file")
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ValueError(f"two files would get the same name in step {step}: {sorted(names)}")
        return named

    async def _upload_files(
        self, step: int, named: list[tuple[str, Path]], deadline: datetime | None
    ) -> list[FileEntry]:
        """Upload the files, with stale multipart uploads cleaned up alongside (never delaying a
        checkpoint taken on a notice by a round trip; a failed cleanup is logged, not fatal)."""

        async def clean_up() -> None:
            try:
                await self.uploader.abort_stale_uploads(step, now=self._clock())
            except StoreError as exc:
                log.warning("stale_multipart_cleanup_failed", error=str(exc))

        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(clean_up())
                upload = tg.create_task(self.uploader.upload_files(step, named, priority(step, deadline is not None)))
        except BaseExceptionGroup as eg:
            raise first_error(eg) from eg
        return list(upload.result())

    async def _publish(self, receipt: WriterReceipt) -> tuple[Manifest | None, int | None, list[int]]:
        """Write this writer's receipt's step's manifest if it completes the step, move ``latest``
        and apply retention: (manifest or None, latest step, steps deleted)."""
        step, writer = receipt.step, receipt.writer
        try:
            manifest = await self.publisher.try_publish(receipt)
        except ProtocolError as exc:
            # Receipts that cannot be merged (writers disagree on who takes part) or a manifest
            # that lists other files: our shards are safe in S3, but the step is not published.
            log.error("checkpoint_publish_rejected", step=step, writer=writer, error=str(exc))
            return None, None, []
        if manifest is None:
            return None, None, []
        latest_step = await self.publisher.advance_latest(step, writer)
        deleted = await self.publisher.apply_retention(self.keep) if manifest.writer == writer else []
        return manifest, latest_step, deleted

    async def wait_complete(self, step: int, timeout_s: float, poll_s: float = 0.5) -> bool:
        """Wait until step N has a manifest (peers still uploading); False on timeout."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        while True:
            if await self.bucket.exists(self.layout.manifest_key(step)):
                return True
            if loop.time() >= until:
                return False
            await asyncio.sleep(min(poll_s, max(0.0, until - loop.time())))

    async def complete_steps(self) -> list[int]:
        return await self.publisher.complete_steps()

    async def restore_latest(self, dest_dir: Path) -> RestoredCheckpoint | None:
        """Newest complete, verified checkpoint into ``dest_dir/step-N``; None if there is none."""
        return await self.restorer.restore_latest(dest_dir)

    @staticmethod
    def _name(path: Path, root: Path | None) -> str:
        name = path.relative_to(root).as_posix() if root is not None else path.name
        return validate_file_name(name)
