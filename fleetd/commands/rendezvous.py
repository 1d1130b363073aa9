"""`fleetd rendezvous`."""

from __future__ import annotations

import argparse
from pathlib import Path

from fleetd.commands.common import add_config_argument, not_built
from fleetd.config import DEFAULT_PATH


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p, DEFAULT_PATH)


def run(args: argparse.Namespace) -> int:
    return not_built("fleetd rendezvous", 6)
