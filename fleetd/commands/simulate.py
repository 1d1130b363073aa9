"""`fleetd simulate`."""

from __future__ import annotations

import argparse
from pathlib import Path

from fleetd.commands.common import add_config_argument, not_built
from fleetd.config import DEFAULT_PATH


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument('--trace', type=Path, required=True, help='spot trace (Bamboo CSV or availability JSON)')
    p.add_argument('--policy', default='all', help='policy name or all')
    p.add_argument('--json', action='store_true', help='print JSON instead of a table')


def run(args: argparse.Namespace) -> int:
    return not_built("fleetd simulate", 9)
