"""Folder mode's I/O: the job's checkpoint folder kept in step with S3 (agent/checkpoint_store).

``restore`` fills an empty folder with the newest durable version before torchrun starts; ``run``
judges the folder every ``poll_s`` (folder_watch.py) and uploads each new complete version, copied
aside and checked again, as the next version number; ``wait_new_version`` waits, after a notice's
signal, for a version the script wrote after it to be durable.
(docs/DESIGN.md "Training loops and what each guarantees")
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.supervise.folder_gate import FolderState, fingerprint, read_want, write_model
from agent.supervise.folder_watch import FolderWatch, Snapshot, open_for_writing, scan
from fleetd.shared.logs import get_logger

log = get_logger(__name__)


@dataclass
class FolderSync:
    folder: Path
    staging: Path  # on the same disk as the folder: copies are cheap and never cross devices
    store: Any  # agent.checkpoint_store.store.CheckpointStore
    writer: str
    settle_s: float = 2.0
    poll_s: float = 0.5
    job_pids: Callable[[], list[int]] = list  # the job's processes (open files are checked)
    on_uploaded: Callable[[Any], Awaitable[None]] | None = None  # UploadResult -> event
    watch: FolderWatch = field(init=False)
    last_version: int = 0
    fresh: bool = False  # the folder was empty at start: this node is a newcomer
    uploaded_at: dict[int, float] = field(default_factory=dict)  # version -> when its files last changed
    # What the folder holds, for torchrun's gate (agent/supervise/folder_gate.py), and where the
    # gate asks for a newer version; None: no gate (tests of the sync alone).
    state_path: Path | None = None
    want_path: Path | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.watch = FolderWatch(settle_s=self.settle_s)

    async def restore(self) -> int | None:
        """Newest durable version into an empty folder; its number (None: nothing restored)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        # Files already there are this node's own, as new as anything it uploaded: left alone.
        if files := await asyncio.to_thread(scan, self.folder):
            self.watch.uploaded(files)
            await self._held(FolderState(files=files))  # of unknown origin: version 0 for the gate
            log.info("folder_restore_skipped", folder=str(self.folder), why="the folder already holds files")
            return None
        self.fresh = True
        return await self._take_latest(lambda: False)

    async def _take_latest(self, too_late: Callable[[], bool]) -> int | None:
        tmp = self.staging / "restore"
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        restored = await self.store.restore_latest(tmp)
        if restored is None or restored.step <= self.last_version or too_late():
            await asyncio.to_thread(shutil.rmtree, tmp, True)
            return None
        await asyncio.to_thread(_replace_contents, restored.directory, self.folder)
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        files = await asyncio.to_thread(scan, self.folder)
        self.watch.uploaded(files)
        version: int = restored.step
        self.last_version = version
        await self._held(FolderState(version=version, fingerprint=fingerprint(restored.manifest.files), files=files))
        log.info("folder_restored", version=version, folder=str(self.folder), nbytes=restored.nbytes)
        return version

    async def refresh_until_started(self, started: Callable[[], bool], poll_s: float = 1.0) -> None:
        """A newcomer (restored into an empty folder) takes every newer durable version until its
        workers start: torchrun starts them only once the node joins a round, possibly minutes
        after the restore, while the survivors keep saving. What is left is a save the survivors
        made in the last seconds before the join (settle + upload), which a script that saves on
        every node would then see at different versions."""
        if not self.fresh:
            return
        while not started():
            try:
                if max(await self.store.complete_steps(), default=0) > self.last_version:
                    async with self._lock:
                        await self._take_latest(started)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the version already in the folder stands
                log.warning("folder_refresh_failed", error=str(exc))
            await asyncio.sleep(poll_s)

    async def run(self) -> None:
        while True:
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - S3 or the disk failing must not stop training
                log.error("folder_poll_failed", error=str(exc))
            await asyncio.sleep(self.poll_s)

    async def _held(self, state: FolderState) -> None:
        if self.state_path is not None:
            await asyncio.to_thread(write_model, self.state_path, state)

    async def poll(self, now: float | None = None) -> int | None:
        """Upload the folder's new complete version, if there is one; its number. First, a
        newer version torchrun's gate asked for (its workers wait for it) goes into the folder."""
        async with self._lock:
            want = await asyncio.to_thread(read_want, self.want_path) if self.want_path is not None else None
            if want is not None and want.at_least > self.last_version:
                return await self._take_latest(lambda: False)
            snap = await asyncio.to_thread(scan, self.folder)
            writing = await asyncio.to_thread(open_for_writing, self.job_pids(), self.folder) if snap else set()
            version = self.watch.observe(snap, writing, time.monotonic() if now is None else now)
            if version is None:
                return None
            return await self._upload(version, self.watch.changed_at)

    async def _upload(self, version: Snapshot, changed_at: float) -> int | None:
        stage = self.staging / "upload"
        await asyncio.to_thread(shutil.rmtree, stage, True)
        copied = await asyncio.to_thread(_copy_version, self.folder, stage, version)
        # Still the same after the copy, and nobody writing: the copy is that version, whole (a save
        # the script starts during the copy cannot tear it).
        if (
            not copied
            or await asyncio.to_thread(scan, self.folder) != dict(version)
            or await asyncio.to_thread(open_for_writing, self.job_pids(), self.folder) & set(version)
        ):
            log.info("folder_changed_while_copied", folder=str(self.folder))
            return None
        # Versions count saves, not training steps (fleetd cannot see the script's step). Each copy is
        # whole (replicated state): nodes that publish one number race, the loser takes the winner's.
        number: int = max([self.last_version, *await self.store.complete_steps()]) + 1
        files = [stage / rel for rel in sorted(version)]
        try:
            result = await self.store.upload_step(number, files, writer=self.writer, root=stage)
        except Exception as exc:  # noqa: BLE001 - a failed upload is retried at the next change or poll
            log.error("folder_upload_failed", version=number, error=str(exc))
            return None
        finally:
            await asyncio.to_thread(shutil.rmtree, stage, True)
        self.last_version = number
        self.uploaded_at[number] = changed_at
        self.watch.uploaded(version)
        await self._held(FolderState(version=number, fingerprint=fingerprint(result.files), files=dict(version)))
        log.info(
            "folder_version_uploaded", version=number, files=len(files), nbytes=result.nbytes, complete=result.complete
        )
        if self.on_uploaded is not None:
            await self.on_uploaded(result)
        return number

    async def pending(self) -> bool:
        """The folder holds files not uploaded (or restored) yet: a save still settling, or one
        still being written."""
        return await asyncio.to_thread(scan, self.folder) != dict(self.watch.baseline or {})

    async def wait_new_version(self, since: float, until: float, workers_alive: Callable[[], bool]) -> int | None:
        """A version whose files changed after ``since`` (monotonic) once it is uploaded; None when
        the workers are gone and the folder settled with nothing new, or at ``until``."""
        gone_at: float | None = None
        while time.monotonic() < until:
            await self.poll()
            fresh = [v for v, t in self.uploaded_at.items() if t > since]
            if fresh:
                return max(fresh)
            if not workers_alive():
                gone_at = gone_at or time.monotonic()
                if time.monotonic() - gone_at > self.settle_s + 2 * self.poll_s:
                    return None
            await asyncio.sleep(self.poll_s / 2)
        return None


def _copy_version(folder: Path, stage: Path, version: Snapshot) -> bool:
    for rel, (size, mtime_ns) in version.items():
        src, dst = folder / rel, stage / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copy2(src, dst)
        except FileNotFoundError:
            return False
        st = dst.stat()
        if st.st_size != size:
            return False
        os.utime(dst, ns=(st.st_atime_ns, mtime_ns))
    return True


def _replace_contents(src: Path, folder: Path) -> None:
    """The folder's files become a restored version's: each renamed into place (same disk), then
    files of the previous version that the new one lacks removed."""
    keep = {p.relative_to(src) for p in src.rglob("*") if p.is_file()}
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        dst = folder / path.relative_to(src)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dst)
    for rel in scan(folder):
        if Path(rel) not in keep:
            (folder / rel).unlink(missing_ok=True)
