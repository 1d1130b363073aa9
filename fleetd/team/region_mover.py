"""The member daemon's side of a region move (fleetd/team/member.py calls `RegionMover.step` on
every pass while the job is stopped for the move): the copy runs as a task of its own, beside the
passes, so a large checkpoint never holds a pass past the watchdog; when it ends, ``region.json``
is written and the daemon is asked to start again in the new region (``on_move``, set by
fleetd/daemon.py). A failed copy is logged and started again on the next pass; the job stays
stopped meanwhile, its checkpoint where it was.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from fleetd.config import FleetdConfig
from fleetd.shared.logs import get_logger
from fleetd.team.region_file import RegionRecord, allowed_regions, in_region, write_region
from fleetd.team.region_move import copy_job_objects

log = get_logger(__name__)


class RegionMover:
    def __init__(self, fleet: str, state_dir: Path, dry_run: bool = False) -> None:
        self.fleet = fleet
        self.state_dir = Path(state_dir)
        self.dry_run = dry_run  # `fleetd run --dry-run`: say what would move, copy and write nothing
        self.on_move: Callable[[str], None] | None = None
        self.moved: RegionRecord | None = None  # this process's completed move
        self._task: asyncio.Task[RegionRecord] | None = None
        self._to: str | None = None
        self._refused: str | None = None

    def target(self, cfg: FleetdConfig, allotted: str | None, training: bool = True) -> str | None:
        """The region the job must move to, or None (it is where its allotment places it). Only
        an allotment that lets it train moves it: a paused or pending job's region is the team's
        guess for later, and moving on every change of that guess would copy for nothing."""
        if allotted is None or allotted == cfg.aws.region or not training:
            return None
        if allotted not in allowed_regions(cfg):
            if self._refused != allotted:
                log.error(
                    "team_region_not_allowed",
                    allotted=allotted,
                    allowed=allowed_regions(cfg),
                    kept=cfg.aws.region,
                    fix="list the region under [[team.regions]] in the job's config",
                )
                self._refused = allotted
            return None
        return allotted

    async def step(self, cfg: FleetdConfig, to: str, why: str) -> None:
        """Start the copy, or see how a failed one went (call once per pass while the job is
        stopped). A copy that ends well writes the region record and asks for the restart itself."""
        if self.moved is not None:
            return  # done: the daemon is starting again in the new region
        if self.dry_run:
            if self._to != to:
                log.warning("team_region_move_dry_run", moving_from=cfg.aws.region, to=to, why=why)
                self._to = to
            return
        task = self._task
        if task is not None and self._to != to:
            await self.close()  # the team changed its mind mid-copy: copy to the new choice
            task = None
        if task is None:
            self._to = to
            self._task = asyncio.create_task(self._move(cfg, to, why), name="team-region-copy")
            log.warning("team_region_copy", moving_from=cfg.aws.region, to=to, why=why)
            return
        if not task.done():
            return
        self._task = None
        exc = None if task.cancelled() else task.exception()
        if task.cancelled() or exc is not None:
            log.error("team_region_copy_failed", to=to, error=repr(exc)[:300], retry="on the next pass")

    async def _move(self, cfg: FleetdConfig, to: str, why: str) -> RegionRecord:
        from fleetd.adapters.aws_clients import open_s3

        dst = in_region(cfg, to)
        async with open_s3(dst) as s3:
            copied = await copy_job_objects(s3, cfg, dst)
        record = RegionRecord(
            job=self.fleet,
            region=to,
            moved_from=cfg.aws.region,
            moved_at=time.time(),
            objects=copied.objects,
            bytes=copied.bytes,
            copy_s=copied.seconds,
            reason=why[:500],
        )
        # The record and the restart go together, even if the copy is cancelled right now: once
        # the record is on disk the job's region is the new one (its next start reads it), so this
        # process must not resume the job in the old one.
        write = asyncio.ensure_future(asyncio.to_thread(write_region, self.state_dir, record))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            await asyncio.wait({write})
            if not write.cancelled() and write.exception() is None:
                self._moved(record)
            raise
        self._moved(record)
        return record

    def _moved(self, record: RegionRecord) -> None:
        self.moved = record
        log.warning(
            "team_region_moved",
            moving_from=record.moved_from,
            to=record.region,
            objects=record.objects,
            bytes=record.bytes,
            copy_s=round(record.copy_s, 2),
        )
        if self.on_move is not None:
            self.on_move(record.region)

    async def wait(self) -> None:
        """Until the copy under way (if any) has ended, well or not."""
        if self._task is not None:
            await asyncio.wait({self._task})

    async def close(self) -> None:
        """Stop a copy under way (the daemon is stopping); the next start copies again."""
        task, self._task = self._task, None
        if task is None or task.done():
            return
        task.cancel()
        await asyncio.wait({task})
