"""Ship a job file's code: pack the workdir, upload the archive once, put the job in the config.

Runs at `fleetd run`'s start, before the launch template is written: the template's user data
then carries the job (entrypoint, setup, env) with the archive's URI and digest, so every node
launched from it runs exactly this version (fleetd/protocol/job_code.py).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError

from fleetd.jobs.job_file import JobFile, load_job_file
from fleetd.jobs.pack import Packed, pack
from fleetd.protocol.job_code import code_key, code_uri
from fleetd.shared.logs import get_logger

if TYPE_CHECKING:
    from fleetd.config import FleetdConfig

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Published:
    uri: str
    digest: str
    uploaded: bool  # False: this version was already in the bucket
    files: int


async def upload_once(s3: Any, bucket: str, key: str, packed: Packed) -> bool:
    """PUT the archive unless an object with its digest is there (a restart, a resubmit of an
    unchanged workdir). S3 checks the body against the SHA-256 sent with it."""
    try:
        await s3.head_object(Bucket=bucket, Key=key)
        return False
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
            raise
    sha_b64 = base64.b64encode(binascii.unhexlify(packed.digest)).decode()
    await s3.put_object(Bucket=bucket, Key=key, Body=packed.data, ChecksumSHA256=sha_b64)
    return True


def apply_job(cfg: FleetdConfig, job: JobFile, published: Published | None) -> FleetdConfig:
    """``cfg`` with its job (and the job's budget overrides) taken from the job file."""
    from fleetd.config import FleetdJobConfig

    group = job.job_group(published.uri if published else "", published.digest if published else "")
    if published is not None:
        group["file"] = cfg.job.file  # kept for status; with the code set it is no second definition
    new_job = FleetdJobConfig.model_validate(group)
    budget = cfg.budget.model_copy(update={k: v for k, v in job.budget.model_dump().items() if v is not None})
    return cfg.model_copy(update={"job": new_job, "budget": budget})


async def publish_job(cfg: FleetdConfig, s3: Any) -> tuple[FleetdConfig, Published]:
    """Read ``cfg.job.file``, pack its workdir, upload it; the config the daemon runs with."""
    assert cfg.job.file is not None
    job, workdir = load_job_file(cfg.job.file)
    packed = await asyncio.to_thread(pack, workdir)
    bucket = cfg.checkpoints.bucket
    key = code_key(cfg.checkpoints.prefix, job.name, packed.digest)
    uploaded = await upload_once(s3, bucket, key, packed)
    published = Published(code_uri(bucket, key), packed.digest, uploaded, len(packed.files))
    log.info(
        "job_code_published",
        job=job.name,
        digest=packed.digest[:12],
        uri=published.uri,
        files=len(packed.files),
        bytes=len(packed.data),
        uploaded=uploaded,
        ignore_file=packed.ignore_file,
        skipped_links=list(packed.skipped_links)[:20],
    )
    return apply_job(cfg, job, published), published
