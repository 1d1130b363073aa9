"""`fleetd demo`."""

from __future__ import annotations

import argparse
from pathlib import Path

from fleetd.commands.common import add_config_argument, not_built
from fleetd.config import DEFAULT_PATH


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument('--nodes', type=int, default=3, help='initial number of nodes (default 3)')
    p.add_argument('--duration', type=float, default=180.0, metavar='S', help='run time in seconds (default 180)')
    g = p.add_mutually_exclusive_group()
    g.add_argument('--scenario', default='default', metavar='NAME', help='named interruption scenario (default: default)')
    g.add_argument('--trace', type=Path, metavar='PATH', help='inject interruptions from a spot trace')
    p.add_argument('--report', type=Path, metavar='FILE', help='write the final report as JSON')


def run(args: argparse.Namespace) -> int:
    return not_built("fleetd demo", 10)
