"""A team job's move to another region (docs/DESIGN.md "Several regions"): once the job is
stopped with its checkpoint durable and every node gone (fleetd/team/member.py), every object
under the job's prefix (its checkpoints and its shipped code) is copied to the new region's
bucket, and only then is ``region.json`` written (fleetd/team/region_file.py). The daemon then
starts again in the new region (``DaemonContext.move_to``) and resumes from the copied checkpoint,
as after any team pause.

Order keeps a half-done copy harmless: step files first, each step's manifest after them (a step
without its manifest is not durable: a reader skips it), the job's ``latest`` pointer last, and
the region record after the whole copy. A copy cut short (the daemon stopped, S3 failing) leaves
the job where it was, stopped; the next pass starts the copy again from the top (CopyObject of an
object already there is a plain overwrite).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fleetd.config import FleetdConfig
from fleetd.protocol.checkpoints import LATEST_NAME, MANIFEST_NAME, CheckpointLayout

# CopyObject copies at most 5 GiB; larger objects go part by part (UploadPartCopy).
COPY_OBJECT_MAX = 5 * 1024**3
PART_BYTES = 512 * 1024**2


@dataclass(frozen=True, slots=True)
class Copied:
    objects: int
    bytes: int
    seconds: float


def job_prefix(cfg: FleetdConfig) -> str:
    return CheckpointLayout(cfg.checkpoints.prefix, cfg.job.name).job_prefix


def copy_order(key: str) -> int:
    """Step files, then manifests, then the latest pointer."""
    name = key.rsplit("/", 1)[-1]
    return 2 if name == LATEST_NAME else 1 if name == MANIFEST_NAME else 0


async def _listed(s3: Any, bucket: str, prefix: str) -> AsyncIterator[tuple[str, int]]:
    paginator = s3.get_paginator("list_objects_v2")
    async for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", ()):
            yield obj["Key"], int(obj["Size"])


async def copy_job_objects(s3: Any, src: FleetdConfig, dst: FleetdConfig) -> Copied:
    """Copy the job's objects from ``src``'s bucket to ``dst``'s (same keys), with an S3 client
    of the destination region (S3 copies across regions server-side)."""
    started = time.monotonic()
    prefix = job_prefix(src)
    objects = [o async for o in _listed(s3, src.checkpoints.bucket, prefix)]
    objects.sort(key=lambda o: (copy_order(o[0]), o[0]))
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
    except Exception:
        await s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        raise
