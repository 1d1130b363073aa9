"""`fleetd job submit`'s other half, in the daemon: a job file handed over while fleetd runs becomes
the job's code version without a restart: packed and uploaded (publish.py), a new launch template
version, the new config into the loop, the job watcher and the planner. A submission that cannot
be shipped (an unreadable file, a refused workdir, S3 refusing the upload) is logged once with the
reason; the job goes on with the version it runs, and the next submit is tried again.
(docs/DESIGN.md "The job file and its code on the nodes (fleetd/jobs, agent/supervise/workspace.py)")
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetd.job_record import SubmitRequest, read_submit
from fleetd.localnet import raise_if_cancelled
from fleetd.shared.logs import get_logger

if TYPE_CHECKING:
    from fleetd.config import FleetdConfig
    from fleetd.jobs.publish import Published

log = get_logger(__name__)
# The job (with its code version) and budget the fleet runs, in the shared state store's meta table.
SHARED_KEY = "job_adopted"


def submitted_job(cfg: FleetdConfig) -> FleetdConfig:
    """``cfg`` with the job file last submitted in place of fleetd.toml's, if there is one: a
    restarted daemon never goes back to old code."""
    try:
        request = read_submit(cfg.fleet.state_dir)
    except Exception as exc:  # noqa: BLE001 - a bad request file must not stop fleetd: its own job runs
        log.error("job_submit_unreadable", error=str(exc)[:300])
        return cfg
    if request is None:
        return cfg
    log.info("job_submitted_file_used", file=str(request.file), digest=request.digest[:12])
    return cfg.model_copy(update={"job": cfg.job.model_copy(update={"file": request.file})})


def job_as_run(cfg: FleetdConfig) -> FleetdConfig:
    """``cfg`` with the job its daemon runs (the submitted or configured job file's settings:
    total steps, pace, budget), for a reader that does not run it (the team's loop). Raises
    ConfigError or OSError when the job file cannot be read."""
    from fleetd.jobs.job_file import load_job_file
    from fleetd.jobs.publish import apply_job

    cfg = submitted_job(cfg)
    if cfg.job.file is None:
        return cfg
    job, _ = load_job_file(cfg.job.file)
    return apply_job(cfg, job, None)


@dataclass
class SubmissionWatcher:
    cfg: FleetdConfig  # what the daemon runs now; its job's code_digest is the version
    publish: Callable[[FleetdConfig], Awaitable[tuple[FleetdConfig, Published]]]
    # The new config into the running daemon: launch template, loop, job watcher, planner.
    adopt: Callable[[FleetdConfig], Awaitable[None]]
    # The version the fleet last adopted, from the state store every control host shares (HA): a
    # host that takes the lead runs it, not the one its own files name. None: a single host.
    recall: Callable[[], Awaitable[FleetdConfig | None]] | None = None
    interval_s: float = 2.0
    _tried: tuple[Path, float] | None = None  # the last request handled (file, submitted_at)
    _unreadable: bool = False  # the request file is bad (said once)
    _recalled: bool = False

    async def check(self) -> str | None:
        """Ship a new submission, if there is one; the digest now running (None: nothing new)."""
        if not self._recalled and self.recall is not None:
            self._recalled = True
            shared = await self.recall()
            if shared is not None and shared.job.code_digest != self.cfg.job.code_digest:
                old = self.cfg.job.code_digest
                await self.adopt(shared)
                self.cfg = shared
                log.warning("job_version_recalled", old=old[:12], new=shared.job.code_digest[:12])
        try:
            request = await asyncio.to_thread(read_submit, self.cfg.fleet.state_dir)
        except Exception as exc:  # noqa: BLE001 - said once per bad file; the job goes on
            if not self._unreadable:
                log.error("job_submit_unreadable", error=str(exc)[:300])
            self._unreadable = True
            return None
        self._unreadable = False
        if request is None or (request.file, request.submitted_at) == self._tried:
            return None
        self._tried = (request.file, request.submitted_at)
        return await self._ship(request)

    async def _ship(self, request: SubmitRequest) -> str | None:
        if self.cfg.capacity.launch_template:
            log.error(
                "job_submit_refused",
                file=str(request.file),
                why=f"capacity.launch_template {self.cfg.capacity.launch_template!r} carries its own user "
                "data: a job file reaches nodes only through fleetd's own template",
            )
            return None
        wanted = self.cfg.model_copy(update={"job": self.cfg.job.model_copy(update={"file": request.file})})
        try:
            new_cfg, published = await self.publish(wanted)
        except Exception as exc:  # noqa: BLE001 - ConfigError, PackError, OSError, S3: the job goes on
            log.error("job_submit_refused", file=str(request.file), error=_reason(exc))
            return None
        if new_cfg.job.name != self.cfg.job.name:
            log.error(
                "job_submit_refused",
                file=str(request.file),
                why=f"the file's job is {new_cfg.job.name!r}; this controller runs {self.cfg.job.name!r}",
            )
            return None
        old = self.cfg.job.code_digest
        if published.digest == old:
            log.info("job_submit_unchanged", digest=old[:12])
            return None
        await self.adopt(new_cfg)
        self.cfg = new_cfg
        log.warning("job_version_shipped", old=old[:12], new=published.digest[:12], uri=published.uri)
        return published.digest

    async def run(self, ctx: Any) -> None:
        while getattr(ctx, "reconciler", None) is None:  # the launch template and the loop come first
            await asyncio.sleep(self.interval_s)
        while True:
            try:
                await self.check()
            except Exception as exc:  # noqa: BLE001 - never take the controller (and its budget) down
                log.error("job_submit_failed", error=repr(exc)[:300], exc_info=exc)
            await asyncio.sleep(self.interval_s)
            raise_if_cancelled()


def submission_component(cfg: FleetdConfig, ctx: Any, signals: Any) -> Callable[[Any], Awaitable[None]]:
    """The watcher as a daemon component (leader only), adopting a shipped version into ``ctx``:
    the launch template first (a node bought after this boots the new version), then the loop's
    config (the job's budget and steps), the planner's code_digest and the job watcher."""

    async def publish(wanted: FleetdConfig) -> tuple[FleetdConfig, Published]:
        from fleetd.jobs.publish import publish_job
        from fleetd.state_backup import open_s3

        async with open_s3(wanted) as s3:
            return await publish_job(wanted, s3)

    async def adopt(new: FleetdConfig) -> None:
        loop = ctx.reconciler
        await loop.ec2.inner.use_template_for(new)
        loop.cfg = new
        await loop.state.set_meta(
            SHARED_KEY, {"job": new.job.model_dump(mode="json"), "budget": new.budget.model_dump(mode="json")}
        )
        ctx.cfg = new
        signals.code_digest = new.job.code_digest
        if ctx.job is not None:
            await ctx.job.new_version(new.job.code_digest, new.job.lifecycle_settings(), new.job.total_steps)
        ctx.wake_loop()

    async def recall() -> FleetdConfig | None:
        raw = await ctx.reconciler.state.get_meta(SHARED_KEY)
        if not raw:
            return None
        job = type(cfg.job).model_validate(raw["job"])
        return cfg.model_copy(update={"job": job, "budget": type(cfg.budget).model_validate(raw["budget"])})

    return SubmissionWatcher(cfg, publish, adopt, recall).run


def _reason(exc: Exception) -> str:
    render = getattr(exc, "render", None)
    return (render() if callable(render) else str(exc))[:600]
