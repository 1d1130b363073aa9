"""`fleetd config check`: print the effective config (secrets redacted) or every invalid field."""

from __future__ import annotations

import argparse

from fleetd.commands.common import add_config_argument
from fleetd.config import DEFAULT_PATH, FleetdConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = sub.add_parser(
        "check",
        help="validate the config; print it with secrets redacted (exit 0) or each error (exit 2)",
    )
    add_config_argument(check, DEFAULT_PATH)


def run(args: argparse.Namespace) -> int:
    from fleetd.shared.settings import config_check

    return config_check(FleetdConfig, args.config)
