"""`fleetd doctor [--config F] [--json]`: is this account, this control host and this config ready
for `fleetd run`? One line per check, ok or what is wrong and how to fix it; exit 1 on a failure.
The fatal subset also runs when `fleetd run` starts (it refuses with the reason)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from fleetd.commands.common import add_config_argument, load_config
from fleetd.config import DEFAULT_PATH
from fleetd.doctor.result import Check

if TYPE_CHECKING:
    from fleetd.config import FleetdConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p, DEFAULT_PATH)
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.add_argument(
        "--service-user",
        default=None,
        metavar="USER",
        help="the user fleetd.service runs as, whose access to the certificate files is checked "
        "(default: fleetd when it exists, else the current user)",
    )


def run(args: argparse.Namespace) -> int:
    import asyncio

    from fleetd.doctor.result import exit_code, render

    cfg = load_config(args.config, "doctor")
    if cfg is None:
        return 2
    checks = asyncio.run(all_checks(cfg, args.service_user))
    if args.json:
        print(json.dumps([c.as_dict() for c in checks], indent=1))
    else:
        print(render(checks))
    return exit_code(checks)


async def all_checks(cfg: FleetdConfig, service_user: str | None) -> list[Check]:
    from aiobotocore.session import get_session

    from fleetd.adapters.region import resolve_region
    from fleetd.doctor.cloud import account_checks
    from fleetd.doctor.host import broker_check, file_checks, identity_check, rendezvous_check
    from fleetd.wiring import store_address

    checks: list[Check] = []
    if not cfg.aws.region:
        aws = await resolve_region(cfg.aws)
        if aws is None:
            checks.append(Check.fail("region", "none found", cfg.aws.missing_region(), fatal=True))
            return checks + file_checks(cfg, service_user)
        cfg = cfg.model_copy(update={"aws": aws})
    session = get_session()
    if cfg.aws.profile:
        session.set_config_variable("profile", cfg.aws.profile)
    checks += await account_checks(cfg, session)
    checks += file_checks(cfg, service_user)
    checks.append(identity_check(cfg))
    checks.append(await broker_check(cfg))
    checks.append(await rendezvous_check(cfg, store_address(cfg)))
    return checks
