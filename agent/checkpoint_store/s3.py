"""Thin aiobotocore adapter for one bucket: the only module that touches botocore.

Every call goes through ``_translated`` so callers see only the store's own errors
(agent.checkpoint_store.errors), never ClientError / aiohttp exceptions. CancelledError is never
caught.

Payload signing is switched off (``payload_signing_enabled=False``): every object fleetd writes
carries an explicit checksum header (``x-amz-checksum-crc32`` per multipart part,
``x-amz-checksum-sha256`` for single PUTs), which is itself signed and which S3 verifies against the
body, so signing the payload as well would only hash every byte again, synchronously on the event
loop (botocore does that over plain http unless told not to).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, BinaryIO

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession, get_session
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.loaders import Loader, create_loader

from agent.checkpoint_store.errors import (
    ObjectNotFound,
    PreconditionFailed,
    StoreError,
    StoreUnavailable,
)

# One botocore session per event loop and profile. A fresh session reads botocore's endpoint and
# service data (megabytes of JSON) again for its first client: per checkpoint that was ~0.5 s of
# CPU, most of an agent's (py-spy, the demo's agents, 2026-11-27). Per loop, because a session's
# refreshable credentials hold an asyncio lock that belongs to the loop that first waited on it.
_SESSIONS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str | None, AioSession]] = (
    weakref.WeakKeyDictionary()
)


def _session(profile: str | None) -> AioSession:
    per_loop = _SESSIONS.setdefault(asyncio.get_running_loop(), {})
    if profile not in per_loop:
        session = get_session()
        if profile:
            session.set_config_variable("profile", profile)
        session.register_component("data_loader", _shared_loader(session.get_config_variable("data_path")))
        per_loop[profile] = session
    return per_loop[profile]


# botocore's parsed data files, shared by every session of the process (per data path). A session
# per loop still meant parsing them again for each loop's first client: ~0.1 s of CPU in every
# ``asyncio.run`` a training rank makes to read S3's ``latest`` when it starts after a re-form
# (agent/trainer/resume.py). The loader only caches what it parsed (botocore shares it between
# all clients of one session the same way); a race between threads at worst parses a file twice.
_LOADERS: dict[str | None, Loader] = {}


def _shared_loader(data_path: str | None) -> Loader:
    loader = _LOADERS.get(data_path)
    if loader is None:
        loader = _LOADERS[data_path] = create_loader(data_path)
    return loader


def warm_client_data() -> None:
    """Parse the files an S3 client reads into the shared loader. The warm pool
    (agent/supervise/warm_pool.py) calls it once, so forked workers start with them parsed: only
    files are read (no client, no credentials, no network, no thread)."""
    loader = _shared_loader(get_session().get_config_variable("data_path"))
    for name in ("endpoints", "sdk-default-configuration", "partitions", "_retry"):
        loader.load_data_with_path(name)
    # Under the very cache keys botocore asks with (the session's call, then the client's two).
    loader.load_service_model("s3", type_name="service-2", api_version=None)
    for kind in ("service-2", "endpoint-rule-set-1"):
        loader.load_service_model("s3", kind, api_version=None)


_NOT_FOUND = {"NoSuchKey", "NotFound", "404", "NoSuchUpload", "NoSuchBucket"}
_PRECONDITION = {"PreconditionFailed", "412", "ConditionalRequestConflict"}
_UNAVAILABLE = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "503", "500"}


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    etag: str


@dataclass(frozen=True, slots=True)
class MultipartInfo:
    key: str
    upload_id: str
    initiated: datetime | None


@dataclass(frozen=True, slots=True)
class CompletedPart:
    number: int
    etag: str
    crc32_b64: str


@contextlib.contextmanager
def _translated(op: str, key: str = "") -> Iterator[None]:
    where = f"{op} {key}".strip()
    try:
        yield
    except ClientError as exc:
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        msg = f"{where}: {code or status} {err.get('Message', '')}".strip()
        if code in _PRECONDITION or status == "412":
            raise PreconditionFailed(msg) from None
        if code in _NOT_FOUND or status == "404":
            raise ObjectNotFound(msg) from None
        if code in _UNAVAILABLE or status in _UNAVAILABLE:
            raise StoreUnavailable(msg) from None
        raise StoreError(msg) from None
    except (BotoConnectionError, aiohttp.ClientError, TimeoutError) as exc:
        raise StoreUnavailable(f"{where}: {type(exc).__name__}: {exc}") from None
    except BotoCoreError as exc:
        raise StoreError(f"{where}: {type(exc).__name__}: {exc}") from None


class S3Bucket:
    """One bucket through one aiobotocore client. Create it with ``S3Bucket.connect(...)``."""

    def __init__(self, client: Any, bucket: str, region: str = "us-east-1"):
        self._client = client
        self.bucket = bucket
        self._region = region

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls,
        bucket: str,
        *,
        region: str,
        endpoint_url: str | None = None,
        profile: str | None = None,
        max_connections: int = 16,
        config: Config | None = None,
    ) -> AsyncIterator[S3Bucket]:
        """``config`` (e.g. retries/timeouts) is merged under fleetd's own settings."""
        base = AioConfig()
        if config is not None:
            base = base.merge(config)  # type: ignore[arg-type]  # takes botocore's Config at runtime; stubs ask for AioConfig
        s3_opts: dict[str, Any] = {"payload_signing_enabled": False}
        if endpoint_url:
            # moto / MinIO / LocalStack endpoints are reached by address: virtual hosts won't resolve.
            s3_opts["addressing_style"] = "path"
        ours = AioConfig(
            max_pool_connections=max_connections,
            s3=s3_opts,
            # We send our own checksum with every upload; don't let botocore add (and compute) another.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        async with _session(profile).create_client(
            "s3", region_name=region, endpoint_url=endpoint_url, config=base.merge(ours)
        ) as client:
            yield cls(client, bucket, region)

    # ------------------------------------------------------------------ bucket
    async def ensure_bucket(self) -> None:
        """Create the bucket if missing (tests, the demo, a fresh account); no-op if it exists."""
        with _translated("HeadBucket", self.bucket):
            try:
                await self._client.head_bucket(Bucket=self.bucket)
                return
            except ClientError as exc:
                if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404:
                    raise
            location = (
                {}
                if self._region == "us-east-1"
                else {"CreateBucketConfiguration": {"LocationConstraint": self._region}}
            )
            try:
                await self._client.create_bucket(Bucket=self.bucket, **location)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in (
                    "BucketAlreadyOwnedByYou",
                    "BucketAlreadyExists",
                ):
                    raise

    # ------------------------------------------------------------------ small objects
    async def put_bytes(
        self,
        key: str,
        data: bytes | BinaryIO,
        *,
        sha256_b64: str,
        if_match: str | None = None,
        if_none_match: bool = False,
        content_type: str = "application/octet-stream",
    ) -> str:
        """PutObject; ``if_match`` = ETag the current object must have, ``if_none_match`` = create
        only if absent. Returns the new ETag. Raises PreconditionFailed if the condition fails."""
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": key,
            "Body": data,
            "ContentType": content_type,
            "ChecksumSHA256": sha256_b64,
        }
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        with _translated("PutObject", key):
            resp = await self._client.put_object(**kwargs)
        etag: str = resp["ETag"]
        return etag

    async def get_bytes(self, key: str) -> tuple[bytes, str]:
        """(body, ETag); ObjectNotFound if absent."""
        with _translated("GetObject", key):
            resp = await self._client.get_object(Bucket=self.bucket, Key=key)
            async with resp["Body"] as body:
                data = await body.read()
        return data, resp["ETag"]

    async def exists(self, key: str) -> bool:
        try:
            with _translated("HeadObject", key):
                await self._client.head_object(Bucket=self.bucket, Key=key)
            return True
        except ObjectNotFound:
            return False

    @contextlib.asynccontextmanager
    async def stream(self, key: str, chunk_size: int = 4 << 20) -> AsyncIterator[AsyncIterator[bytes]]:
        """``async with bucket.stream(key) as chunks: async for c in chunks: ...``"""
        with _translated("GetObject", key):
            resp = await self._client.get_object(Bucket=self.bucket, Key=key)

        async def chunks() -> AsyncIterator[bytes]:
            with _translated("GetObject(read)", key):
                async for c in resp["Body"].iter_chunks(chunk_size):
                    yield c

        async with resp["Body"]:
            yield chunks()

    # ------------------------------------------------------------------ listing, deleting
    async def list_objects(self, prefix: str) -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        with _translated("ListObjectsV2", prefix):
            paginator = self._client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                for o in page.get("Contents", []):
                    out.append(ObjectInfo(o["Key"], int(o["Size"]), o.get("ETag", "")))
        return out

    async def list_subprefixes(self, prefix: str) -> list[str]:
        """The 'directories' directly under ``prefix`` (CommonPrefixes with delimiter '/')."""
        out: list[str] = []
        with _translated("ListObjectsV2", prefix):
            paginator = self._client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/"):
                out.extend(p["Prefix"] for p in page.get("CommonPrefixes", []))
        return out

    async def delete_keys(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            with _translated("DeleteObjects", batch[0]["Key"]):
                resp = await self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            if resp.get("Errors"):
                first = resp["Errors"][0]
                raise StoreError(f"DeleteObjects {first.get('Key')}: {first.get('Code')} {first.get('Message')}")

    # ------------------------------------------------------------------ multipart
    async def create_multipart(self, key: str) -> str:
        with _translated("CreateMultipartUpload", key):
            resp = await self._client.create_multipart_upload(Bucket=self.bucket, Key=key, ChecksumAlgorithm="CRC32")
        upload_id: str = resp["UploadId"]
        return upload_id

    async def upload_part(
        self, key: str, upload_id: str, number: int, body: bytes | BinaryIO, crc32_b64: str
    ) -> CompletedPart:
        """One part with its CRC32 (S3 rejects the part if the bytes it got don't match)."""
        with _translated("UploadPart", f"{key}#{number}"):
            resp = await self._client.upload_part(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
                ChecksumCRC32=crc32_b64,
            )
        return CompletedPart(number, resp["ETag"], crc32_b64)

    async def complete_multipart(self, key: str, upload_id: str, parts: list[CompletedPart]) -> str:
        ordered = sorted(parts, key=lambda p: p.number)
        with _translated("CompleteMultipartUpload", key):
            resp = await self._client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={
                    "Parts": [{"PartNumber": p.number, "ETag": p.etag, "ChecksumCRC32": p.crc32_b64} for p in ordered]
                },
            )
        etag: str = resp.get("ETag", "")
        return etag

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        with _translated("AbortMultipartUpload", key):
            await self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)

    async def list_multipart_uploads(self, prefix: str) -> list[MultipartInfo]:
        out: list[MultipartInfo] = []
        with _translated("ListMultipartUploads", prefix):
            paginator = self._client.get_paginator("list_multipart_uploads")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                for u in page.get("Uploads", []):
                    out.append(MultipartInfo(u["Key"], u["UploadId"], u.get("Initiated")))
        return out
