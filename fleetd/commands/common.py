"""Argument helpers shared by several subcommands."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_config_argument(p: argparse.ArgumentParser, default: Path) -> None:
    p.add_argument(
        "--config",
        type=Path,
        default=default,
        metavar="PATH",
        help=f"TOML config file (default: {default}); FLEETD_* environment variables override it",
    )


def not_built(command: str, issue: int) -> int:
    """Commands whose feature has not landed say so plainly and fail; they never fake output."""
    print(f"{command}: not built yet (tracked in issue {issue})", file=sys.stderr)
    return 3


def load_config(path: Path | None, command: str) -> Any:
    """fleetd.toml (plus FLEETD_* overrides), or None after printing what is wrong, field by field."""
    from fleetd.config import load
    from fleetd.shared.settings import ConfigError

    try:
        return load(path)
    except ConfigError as exc:
        print(f"fleetd {command}: " + exc.render(), file=sys.stderr)
        return None
