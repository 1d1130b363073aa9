"""Making step N visible once every node's shards are in S3: receipts → manifest → ``latest``.

Each node writes a receipt for its own files; whichever node then sees every expected receipt
merges them and creates ``MANIFEST.json`` (If-None-Match: one create wins, no controller
round-trip). ``latest`` only moves forward (If-Match). Both writes are read back, since a store may
not honour the conditions. Retention deletes old steps, manifest first.
(docs/DESIGN.md "Durable checkpoints")
"""

from __future__ import annotations

import base64
import hashlib
from collections import defaultdict

from agent.checkpoint_store.errors import ObjectNotFound, PreconditionFailed, StoreError
from agent.checkpoint_store.s3 import S3Bucket
from fleetd.protocol.checkpoints import (
    MANIFEST_NAME,
    CheckpointLayout,
    LatestPointer,
    Manifest,
    WriterReceipt,
    merge_receipts,
    parse_latest,
    parse_manifest,
    parse_receipt,
    shard_receipts_complete,
)
from fleetd.protocol.errors import ProtocolError
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

_LATEST_ATTEMPTS = 8


def _b64sha(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


class Publisher:
    def __init__(self, bucket: S3Bucket, layout: CheckpointLayout):
        self._bucket = bucket
        self._layout = layout

    async def write_receipt(self, receipt: WriterReceipt) -> None:
        data = receipt.to_json()
        key = self._layout.receipt_key(receipt.step, receipt.writer)
        await self._bucket.put_bytes(key, data, sha256_b64=_b64sha(data), content_type="application/json")

    async def read_receipts(self, step: int) -> list[WriterReceipt]:
        out = []
        for obj in await self._bucket.list_objects(self._layout.receipts_prefix(step)):
            try:
                data, _ = await self._bucket.get_bytes(obj.key)
                out.append(parse_receipt(data, source=obj.key, job=self._layout.job, step=step))
            except ObjectNotFound:
                continue
            except ProtocolError as exc:
                log.warning("checkpoint_receipt_rejected", key=obj.key, error=str(exc))
        return out

    async def read_manifest(self, step: int) -> Manifest | None:
        """The manifest of step N, None if absent; ProtocolError if present but invalid."""
        key = self._layout.manifest_key(step)
        try:
            data, _ = await self._bucket.get_bytes(key)
        except ObjectNotFound:
            return None
        return parse_manifest(data, source=key, job=self._layout.job, step=step)

    async def try_publish(self, own: WriterReceipt) -> Manifest | None:
        """Write step N's manifest if every expected writer's receipt is there; return the stored
        manifest (ours or the one that beat us), or None while receipts are still missing."""
        step, writer, expected_writers = own.step, own.writer, own.expected_writers
        # S3 is read-after-write consistent, so the node whose receipt PUT finished last lists every
        # receipt: some node always publishes.
        if expected_writers != (writer,):  # the caller named every writer of the step
            receipts = [r for r in await self.read_receipts(step) if r.writer in expected_writers]
            if {r.writer for r in receipts} != set(expected_writers):
                return None
        elif own.is_shard:
            # Sharded state from nodes that do not know each other: the metadata's file list
            # (carried by one receipt) says when the parts add up to the step.
            found = shard_receipts_complete(await self.read_receipts(step))
            if found is None:
                return None
            receipts = found
        else:
            receipts = [own]  # a single writer: no need to list what we just wrote
        ours = merge_receipts(receipts, job=self._layout.job, step=step, merged_by=writer)
        key = self._layout.manifest_key(step)
        data = ours.to_json()
        try:
            await self._bucket.put_bytes(
                key, data, sha256_b64=_b64sha(data), if_none_match=True, content_type="application/json"
            )
        except PreconditionFailed:
            log.debug("manifest_already_written", step=step, writer=writer)
        # Read back, not trusting If-None-Match: moto checks it before writing, not atomically, and
        # other S3-compatible stores may ignore it. The merge is deterministic (sorted files and
        # writers), so a lost race leaves a manifest that differs only in writer/created_at.
        stored = await self.read_manifest(step)  # read-after-write: trust what S3 holds
        if stored is None:
            raise StoreError(f"{key} vanished right after it was written")
        if not stored.same_content(ours):
            if expected_writers == (writer,) and not own.is_shard and writer not in stored.writers:
                # Replicated state: every node uploads a whole copy of step N, and another
                # node's copy was published first. The step is durable; ours is a spare.
                log.debug("checkpoint_published_by_peer", step=step, writer=writer, by=stored.writer)
                return stored
            raise ProtocolError(f"{key} lists other files than the receipts of step {step}")
        return stored

    async def read_latest(self) -> tuple[LatestPointer | None, str | None]:
        """(pointer, ETag); (None, None) if absent. ProtocolError if present but invalid."""
        key = self._layout.latest_key()
        try:
            data, etag = await self._bucket.get_bytes(key)
        except ObjectNotFound:
            return None, None
        return parse_latest(data, source=key, job=self._layout.job), etag

    async def advance_latest(self, step: int, writer: str) -> int:
        """Point ``latest`` at step N unless it already names N or newer; returns the step it names."""
        key = self._layout.latest_key()
        for _ in range(_LATEST_ATTEMPTS):
            try:
                current, etag = await self.read_latest()
            except ProtocolError as exc:
                # A corrupt pointer is replaced (readers list the steps anyway); keep its ETag.
                log.warning("latest_pointer_rejected", key=key, error=str(exc))
                current, etag = None, (await self._bucket.get_bytes(key))[1]
            if current is not None and current.step >= step:
                return current.step
            data = LatestPointer(job=self._layout.job, step=step, writer=writer).to_json()
            try:
                await self._bucket.put_bytes(
                    key,
                    data,
                    sha256_b64=_b64sha(data),
                    if_match=etag,
                    if_none_match=etag is None,
                    content_type="application/json",
                )
            except (PreconditionFailed, ObjectNotFound):
                continue  # someone moved it (or deleted it) between our read and write: re-read
            check, _ = await self.read_latest()  # If-Match may be ignored: an older step goes round again
            if check is not None and check.step >= step:
                return check.step
        raise StoreError(f"{key}: could not advance to step {step} after {_LATEST_ATTEMPTS} attempts")

    async def steps(self) -> dict[int, list[str]]:
        """Every step under the job prefix with its keys (one listing of the prefix)."""
        by_step: dict[int, list[str]] = defaultdict(list)
        for obj in await self._bucket.list_objects(self._layout.job_prefix):
            step = self._layout.step_of_key(obj.key)
            if step is not None:
                by_step[step].append(obj.key)
        return dict(by_step)

    async def complete_steps(self) -> list[int]:
        """Steps that have a manifest, newest first (not verified: restore does that)."""
        return sorted(
            (s for s, keys in (await self.steps()).items() if self._layout.manifest_key(s) in keys),
            reverse=True,
        )

    async def apply_retention(self, keep: int) -> list[int]:
        """Keep the newest ``keep`` complete steps; delete older complete steps and incomplete
        leftovers older than the oldest kept one, never the step ``latest`` names. Called after a
        newer step was published, by the node the stored manifest names (one deleter per step).
        A step's manifest goes first, so readers stop trusting it before its files go. Returns the
        deleted steps."""
        if keep < 1:
            raise ValueError("keep must be >= 1")
        by_step = await self.steps()
        complete = sorted((s for s, keys in by_step.items() if self._layout.manifest_key(s) in keys), reverse=True)
        kept = complete[:keep]
        if not kept:
            return []
        oldest_kept = kept[-1]
        try:
            latest, _ = await self.read_latest()
        except ProtocolError:
            latest = None
        protected = set(kept) | ({latest.step} if latest else set())
        doomed = sorted(s for s in by_step if s < oldest_kept and s not in protected)
        for step in doomed:
            keys = by_step[step]
            manifest = [k for k in keys if k.endswith("/" + MANIFEST_NAME)]
            await self._bucket.delete_keys(manifest)
            await self._bucket.delete_keys(k for k in keys if k not in manifest)
            log.info("checkpoint_deleted", step=step, objects=len(keys), reason=f"retention keeps {keep}")
        return doomed
