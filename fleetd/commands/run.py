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
    from fleetd.daemon import run_daemon
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
    try:
        return asyncio.run(run_daemon(cfg, planner=plan, dry_run=args.dry_run, passes=args.passes))
    except (AwsError, PriceBookError, SpotAdvisorError) as exc:
        # Start-up failures (no AMI, no permission, bad price book): one clear line, exit 1.
        log.error("startup_failed", error=str(exc))
        return 1
