"""A team job's move to another region (docs/DESIGN.md "Several regions"): once the job is
stopped with its checkpoint durable and every node gone (fleetd/team/member.py), what it needs
under its prefix is copied to the new region's bucket, and only then is ``region.json`` written
(fleetd/team/region_file.py). The daemon then
starts again in the new region (``DaemonContext.move_to``) and resumes from the copied checkpoint,
as after any team pause.

Only what a resume needs is copied: the two newest durable steps, the ``latest`` pointer and
the job's shipped code (older retained steps stay where they are). Order keeps a half-done copy
harmless: step files first, each step's manifest after them (a step
without its manifest is not durable: a reader skips it), the job's ``latest`` pointer last, and
the region record after the whole copy. A copy cut short (the daemon stopped, S3 failing) leaves
the job where it was, stopped; the next pass starts the copy again from the top (CopyObject of an
object already there is a plain overwrite).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fleetd.config import FleetdConfig
from fleetd.protocol.checkpoints import LATEST_NAME, MANIFEST_NAME, CheckpointLayout

# CopyObject copies at most 5 GiB; larger objects go part by part (UploadPartCopy).
COPY_OBJECT_MAX = 5 * 1024**3
PART_BYTES = 512 * 1024**2
KEEP_STEPS = 2  # durable steps copied: the newest and the one a corrupt newest falls back to


@dataclass(frozen=True, slots=True)
class Copied:
    objects: int
    bytes: int
    seconds: float


def layout_of(cfg: FleetdConfig) -> CheckpointLayout:
    return CheckpointLayout(cfg.checkpoints.prefix, cfg.job.name)


def job_prefix(cfg: FleetdConfig) -> str:
    return layout_of(cfg).job_prefix


def copy_order(key: str) -> int:
    """Step files, then manifests, then the latest pointer."""
    name = key.rsplit("/", 1)[-1]
    return 2 if name == LATEST_NAME else 1 if name == MANIFEST_NAME else 0


async def _listed(s3: Any, bucket: str, prefix: str) -> AsyncIterator[tuple[str, int]]:
    paginator = s3.get_paginator("list_objects_v2")
    async for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", ()):
            yield obj["Key"], int(obj["Size"])


def to_copy(layout: CheckpointLayout, objects: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """What a move needs: the two newest durable steps (those with their manifest), the ``latest``
    pointer and whatever is not a step (the job's shipped code); older retained steps stay. In
    copy order."""
    steps: dict[int, list[tuple[str, int]]] = {}
    rest = []
    for key, size in objects:
        step = layout.step_of_key(key)
        if step is None:
            rest.append((key, size))
        else:
            steps.setdefault(step, []).append((key, size))
    durable = sorted(n for n, files in steps.items() if any(k == layout.manifest_key(n) for k, _ in files))
    # The restore takes the newest step with a valid manifest and falls back to older ones on a
    # corrupt file: the one before the newest goes too, so that fallback exists in the new region.
    chosen = [*rest, *(f for n in durable[-KEEP_STEPS:] for f in steps[n])]
    return sorted(chosen, key=lambda o: (copy_order(o[0]), o[0]))


async def copy_job_objects(s3: Any, src: FleetdConfig, dst: FleetdConfig) -> Copied:
    """Copy what the job needs to resume from ``src``'s bucket to ``dst``'s (same keys), with an
    S3 client of the destination region (S3 copies across regions server-side)."""
    started = time.monotonic()
    layout = layout_of(src)
    objects = to_copy(layout, [o async for o in _listed(s3, src.checkpoints.bucket, layout.job_prefix)])
    total = 0
    for key, size in objects:
        source = {"Bucket": src.checkpoints.bucket, "Key": key}
        if size <= COPY_OBJECT_MAX:
            await s3.copy_object(Bucket=dst.checkpoints.bucket, Key=key, CopySource=source)
        else:
            await _copy_in_parts(s3, source, dst.checkpoints.bucket, key, size)
        total += size
    return Copied(len(objects), total, time.monotonic() - started)


async def _copy_in_parts(s3: Any, source: dict[str, str], bucket: str, key: str, size: int) -> None:
    upload = await s3.create_multipart_upload(Bucket=bucket, Key=key)
    upload_id = upload["UploadId"]
    try:
        parts = []
        for number, start in enumerate(range(0, size, PART_BYTES), start=1):
            end = min(size, start + PART_BYTES) - 1
            part = await s3.upload_part_copy(
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                CopySource=source,
                CopySourceRange=f"bytes={start}-{end}",
            )
            parts.append({"PartNumber": number, "ETag": part["CopyPartResult"]["ETag"]})
        await s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts})
    except BaseException:
        # Cancelled too (the daemon stopping, the team changing its mind): an unfinished upload's
        # parts are billed until aborted. Shielded, so the abort itself is not cut short.
        await asyncio.shield(s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id))
        raise
