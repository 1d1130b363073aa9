"""`fleetd run`: the controller daemon (reconcile loop and its components)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

from fleetd.commands.common import add_config_argument
from fleetd.config import DEFAULT_PATH

_T = TypeVar("_T")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p, DEFAULT_PATH)
    p.add_argument("--dry-run", action="store_true", help="plan and log actions without side effects")
    p.add_argument(
        "--passes",
        type=int,
        metavar="N",
        help="stop after N reconcile passes (default: run until SIGTERM/SIGINT)",
    )


def run(args: argparse.Namespace) -> int:
    from fleetd import config as config_mod
    from fleetd.adapters.aws_errors import AwsError
    from fleetd.adapters.pricing import PriceBookError
    from fleetd.adapters.spot_advisor import SpotAdvisorError
    from fleetd.daemon import DaemonContext, run_daemon
    from fleetd.policy.planner import plan
    from fleetd.reconcile.ledger_store import LedgerStoreError
    from fleetd.reconcile.schema import SchemaTooNew
    from fleetd.shared.logs import bind_context, configure_logging, get_logger
    from fleetd.shared.settings import ConfigError
    from fleetd.shared.torch_support import untested_torch
    from fleetd.team.region_file import RegionError, effective_config
    from fleetd.wiring import production_plugins

    if (why := untested_torch()) is not None:
        print(f"fleetd run: {why}", file=sys.stderr)
        return 2
    try:
        cfg = config_mod.load(args.config)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return 2
    if args.passes is not None and args.passes < 1:
        print("--passes must be >= 1", file=sys.stderr)
        return 2
    configure_logging(cfg.logging.level, json=cfg.logging.json_lines)
    bind_context(fleet=cfg.fleet.name, component="fleetd")
    log = get_logger("fleetd.run")

    async def once() -> tuple[int, str | None]:
        """One run of the daemon; the region it must start again in after a team move, if any."""
        here = effective_config(cfg)  # where the job's checkpoints are (fleetd/team/region_file.py)
        ready = await _ready_to_start(here, dry_run=args.dry_run, log=log)
        if ready is None:
            return 2, None
        ctx = DaemonContext(ready)
        if not args.dry_run:
            from fleetd.state_backup import restore_at_start

            await restore_at_start(ready)  # before anything opens the DB
        plugins, ledger = await production_plugins(ready, ctx, dry_run=args.dry_run)
        try:
            status = await run_daemon(
                ready, planner=plan, plugins=plugins, dry_run=args.dry_run, passes=args.passes, ctx=ctx
            )
        finally:
            if ledger is not None:
                await ledger.close()
        return status, ctx.moved_to

    async def main() -> int:
        while True:
            status, moved_to = await once()
            if moved_to is None or status != 0:
                return status  # (a failed stop after a move: systemd restarts it, in the new region)
            log.warning("daemon_starting_in_region", region=moved_to)

    try:
        status = run_bounded(main())
    except RegionError as exc:
        print(f"fleetd run: {exc}", file=sys.stderr)
        status = 2
    except SchemaTooNew as exc:
        # A rollback onto a newer build's state: nothing was touched; say so in one plain line.
        print(f"fleetd run: {exc}", file=sys.stderr)
        status = 2
    except (AwsError, PriceBookError, SpotAdvisorError, LedgerStoreError) as exc:
        # Start-up failures (bad price book, unreadable state): one clear line, exit 1.
        log.error("startup_failed", error=str(exc))
        status = 1
    return exit_bounded(status)


async def _ready_to_start(cfg: Any, *, dry_run: bool, log: Any) -> Any:
    """The config the daemon runs with, once what must hold before buying holds: a region (config,
    environment, profile or IMDS), the fatal doctor checks (not on a dry run), the job's code
    shipped. None (after printing why) when fleetd must not start."""
    if not cfg.aws.region:
        from fleetd.adapters.region import resolve_region

        aws = await resolve_region(cfg.aws)
        if aws is None:
            print(f"fleetd run: {cfg.aws.missing_region()}", file=sys.stderr)
            return None
        cfg = cfg.model_copy(update={"aws": aws})
    log.info("aws_region", region=cfg.aws.region, source=cfg.aws.region_source)
    if not dry_run:
        from aiobotocore.session import get_session

        from fleetd.doctor.preflight import preflight

        refused = await preflight(cfg, get_session())
        if refused:
            for check in refused:
                print(f"fleetd run: {check.name}: {check.detail}\n  fix: {check.fix}", file=sys.stderr)
            print("fleetd run: not started (`fleetd doctor` checks everything)", file=sys.stderr)
            return None
    from fleetd.jobs.submission import submitted_job

    cfg = submitted_job(cfg)  # a job file handed over by `fleetd job submit` runs, not fleetd.toml's
    if cfg.job.file is not None:
        return await _ship_job(cfg, dry_run=dry_run)
    return cfg


async def _ship_job(cfg: Any, *, dry_run: bool) -> Any:
    """The job file's code packed and uploaded; the config with the job from the file. None (after
    saying why on stderr) when the file or its workdir cannot be used."""
    from fleetd.jobs.job_file import load_job_file
    from fleetd.jobs.pack import PackError, pack
    from fleetd.jobs.publish import apply_job, publish_job
    from fleetd.shared.settings import ConfigError
    from fleetd.state_backup import open_s3

    try:
        if dry_run:  # checked and packed, not uploaded
            job, workdir = load_job_file(cfg.job.file)
            await asyncio.to_thread(pack, workdir)
            return apply_job(cfg.model_copy(update={"job": cfg.job.model_copy(update={"file": None})}), job, None)
        async with open_s3(cfg) as s3:
            shipped, _ = await publish_job(cfg, s3)
        return shipped
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
    except PackError as exc:
        print(f"fleetd run: {exc}", file=sys.stderr)
    return None


# After the daemon's own bounded shutdown, how long worker threads (a blocking connect, a DNS
# lookup run through asyncio.to_thread) may take before the process exits without them.
THREAD_GRACE_S = 5.0


def run_bounded(coro: Coroutine[Any, Any, _T]) -> _T:
    """asyncio.run without its unbounded wait for the default executor's threads: a worker stuck
    in a blocking call must not keep a stopping daemon alive past systemd's stop timeout."""
    import asyncio

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            leftover = asyncio.all_tasks(loop)
            for task in leftover:
                task.cancel()
            if leftover:
                loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()  # shuts the executor down without waiting for its threads


def exit_bounded(status: int, grace_s: float = THREAD_GRACE_S) -> int:
    import os
    import threading
    import time

    from fleetd.shared.logs import get_logger

    deadline = time.monotonic() + grace_s
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    for t in others:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in others if t.is_alive()]
    if stuck:
        get_logger("fleetd.run").warning("exit_with_stuck_threads", threads=stuck, grace_s=grace_s)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # the interpreter would join them forever
    return status
