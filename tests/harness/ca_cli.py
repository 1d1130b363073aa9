"""`fleetd ca init` through the real command line, as an operator runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def ca_init(directory: Path, *args: str, broker_names: tuple[str, ...] = ("b",)) -> subprocess.CompletedProcess[str]:
    names = [a for n in broker_names for a in ("--broker-name", n)]
    argv = [sys.executable, "-m", "fleetd.cli", "ca", "init", "--dir", str(directory), *names, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)
