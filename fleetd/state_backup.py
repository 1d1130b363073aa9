"""The state DB off the control host: an online copy in the checkpoint bucket, restored at start.

``fleetd.db`` holds what EC2's tags cannot give back: the ledger (the spend so far) and the pools'
history. Every ``fleet.state_backup_interval_s`` (0: off) an online SQLite backup goes, when it
changed, to ``s3://<checkpoints.bucket>/_fleetd-state/<fleet.name>/fleetd.db``; ``fleetd run``
restores it when the local file is missing, never over one. A restore loses at most one interval
(docs/DESIGN.md "Failure model"). SQLite and file work run in worker threads.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetd.adapters.aws_clients import open_s3, s3_client_kwargs
from fleetd.shared.logs import get_logger
from fleetd.shared.waits import wait_set

log = get_logger(__name__)

__all__ = ["open_s3", "s3_client_kwargs"]  # the state backup's clients, for existing callers

DB_NAME = "fleetd.db"  # fleetd.reconcile.ledger_store.DB_NAME (not imported: no DB code needed here)


# Outside the checkpoint prefix: the nodes' IAM policy may write anything under it, and a node
# must not be able to plant the state (the spend so far) a controller restores.
BACKUP_PREFIX = "_fleetd-state"  # deploy/iam: the controller's grant; never under the nodes' prefix


def backup_key(cfg: Any) -> str:
    return "/".join((BACKUP_PREFIX, cfg.fleet.name, DB_NAME))


def snapshot(src: Path, dest: Path) -> str:
    """A consistent copy of the live DB (SQLite online backup; readers and the writer go on).
    Returns the copy's SHA-256."""
    live = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
    try:
        copy = sqlite3.connect(dest)
        try:
            live.backup(copy)
        finally:
            copy.close()
    finally:
        live.close()
    return hashlib.sha256(dest.read_bytes()).hexdigest()


def _install(data: bytes, path: Path) -> None:
    """Write a restored DB atomically, and only where none exists (never over a live one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".restore-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        check = sqlite3.connect(tmp)  # a torn or foreign object is refused, not installed
        try:
            if check.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
                raise sqlite3.DatabaseError("integrity_check failed")
        finally:
            check.close()
        os.link(tmp, path)  # fails if a DB appeared meanwhile: never replace one
    finally:
        os.unlink(tmp)


async def restore_at_start(cfg: Any) -> bool:
    """``fleetd run``'s first step: restore a missing DB from its backup (when backups are on).
    S3 trouble is logged and start-up goes on with a new DB, as before backups existed."""
    if cfg.fleet.state_backup_interval_s <= 0 or (Path(cfg.fleet.state_dir) / DB_NAME).exists():
        return False
    try:
        async with open_s3(cfg) as s3:
            return await restore_if_missing(cfg, s3)
    except Exception as exc:  # noqa: BLE001 - botocore's errors are many; a new DB is the fallback
        log.error("state_db_restore_failed", error=repr(exc)[:300], why="starting with a new DB")
        return False


async def restore_if_missing(cfg: Any, s3: Any) -> bool:
    """At start, before the DB is opened: fetch the backup when there is no local DB. True when
    a backup was restored. A missing backup (a new fleet) is not an error."""
    path = Path(cfg.fleet.state_dir) / DB_NAME
    if path.exists():
        return False
    bucket, key = cfg.checkpoints.bucket, backup_key(cfg)
    from botocore.exceptions import ClientError

    try:
        resp = await s3.get_object(Bucket=bucket, Key=key)
        async with resp["Body"] as body:
            data = await body.read()
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("NoSuchKey", "NoSuchBucket", "404"):
            raise
        log.warning("state_db_new", path=str(path), why=f"no local DB and no backup at s3://{bucket}/{key}")
        return False
    try:
        await asyncio.to_thread(_install, data, path)
    except (sqlite3.DatabaseError, FileExistsError) as exc:
        log.error("state_db_restore_refused", key=key, error=str(exc))
        return False
    log.warning(
        "state_db_restored",
        path=str(path),
        source=f"s3://{bucket}/{key}",
        bytes=len(data),
        last_modified=str(resp.get("LastModified")),
    )
    return True


@dataclass
class StateBackup:
    """The daemon component: back the DB up every ``interval_s``, when it changed."""

    cfg: Any
    interval_s: float
    s3: Any = None  # an aiobotocore S3 client (run() opens one when None)
    last_digest: str | None = None
    uploads: int = 0

    async def once(self) -> bool:
        src = Path(self.cfg.fleet.state_dir) / DB_NAME
        if not src.exists():
            return False
        with tempfile.TemporaryDirectory(prefix="fleetd-backup-") as tmp:
            dest = Path(tmp) / DB_NAME
            digest = await asyncio.to_thread(snapshot, src, dest)
            if digest == self.last_digest:
                return False
            data = await asyncio.to_thread(dest.read_bytes)
        await self.s3.put_object(
            Bucket=self.cfg.checkpoints.bucket, Key=backup_key(self.cfg), Body=data, ChecksumAlgorithm="SHA256"
        )
        self.last_digest, self.uploads = digest, self.uploads + 1
        log.info("state_db_backed_up", key=backup_key(self.cfg), bytes=len(data))
        return True

    async def run(self, ctx: Any) -> None:
        if self.s3 is None:
            async with open_s3(self.cfg) as s3:
                self.s3 = s3
                try:
                    await self._loop(ctx)
                finally:
                    self.s3 = None
            return
        await self._loop(ctx)

    async def _loop(self, ctx: Any) -> None:
        # First copy one interval after start: the DB was just opened (or restored) as it is.
        while not ctx.stopping.is_set():
            if await wait_set(ctx.stopping, self.interval_s):
                return
            try:
                await self.once()
            except Exception as exc:  # noqa: BLE001 - a failed backup is retried; never stop the daemon
                log.error("state_db_backup_failed", error=repr(exc)[:300])
