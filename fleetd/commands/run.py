"""`fleetd run`: the controller daemon (reconcile loop and its components)."""

from __future__ import annotations

import argparse
import sys

from fleetd.commands.common import add_config_argument
from fleetd.config import DEFAULT_PATH


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p, DEFAULT_PATH)
    p.add_argument('--dry-run', action='store_true', help='plan and log actions without side effects')
    p.add_argument(
        '--passes',
        type=int,
        metavar='N',
        help='stop after N reconcile passes (default: run until SIGTERM/SIGINT)',
    )


def run(args: argparse.Namespace) -> int:
    import asyncio

    from fleetd import config as config_mod
    from fleetd.adapters.aws_errors import AwsError
    from fleetd.adapters.pricing import PriceBookError
    from fleetd.adapters.spot_advisor import SpotAdvisorError
    from fleetd.daemon import DaemonContext, run_daemon
    from fleetd.reconcile.ledger_store import LedgerStoreError
    from fleetd.policy.planner import plan
    from fleetd.protocol.logs import bind_context, configure_logging, get_logger
    from fleetd.protocol.settings import ConfigError

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
    async def main() -> int:
        ctx = DaemonContext(cfg)
        plugins, ledger = await plugins_for(cfg, ctx, dry_run=args.dry_run)
        try:
            return await run_daemon(cfg, planner=plan, plugins=plugins, dry_run=args.dry_run,
                                    passes=args.passes, ctx=ctx)
        finally:
            if ledger is not None:
                await ledger.close()

    try:
        return asyncio.run(main())
    except (AwsError, PriceBookError, SpotAdvisorError, LedgerStoreError) as exc:
        # Start-up failures (no AMI, no permission, bad price book): one clear line, exit 1.
        log.error("startup_failed", error=str(exc))
        return 1


async def plugins_for(cfg, ctx, *, dry_run: bool):
    """The components of a production `fleetd run`: MQTT (and SQS) intake feeding the node
    registry the loop observes through, /metrics + status.json, and the budget ledger.
    A dry run gets no ledger (it would write); its spend comes from the state's estimate."""
    from fleetd.daemon import Plugins
    from fleetd.intake.wiring import build_intake
    from fleetd.publish import status_component
    from fleetd.reconcile.ledger_store import DB_NAME, LedgerStore

    intake = build_intake(cfg, wake=ctx.wake_loop)
    ledger = None if dry_run else await LedgerStore.open(cfg.fleet.state_dir / DB_NAME)
    plugins = Plugins(
        components=[*intake.components(), status_component()],
        observer=intake.registry,
        ledger=ledger,
    )
    return plugins, ledger
