"""The torch releases fleetd is tested with, and a check that refuses the others at start.

fleetd reads torch's private rendezvous state (the pickled ``_RendezvousState`` of the c10d
backend: fleetd/rendezvous/state.py, agent/supervise/torchrun_main.py) and relies on
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``. Neither is an API: a torch release may change them, and a
node image built with "the newest torch" would then fail in the middle of a job instead of at
start. pyproject.toml pins the same range; FLEETD_ALLOW_UNTESTED_TORCH=1 lets an operator try
another release on purpose (logged as such)."""

from __future__ import annotations

import os
from importlib import metadata

# Tested: 2.11 (a GPU run of bench/gpu_check.py, docs/measurements/2026-11-gpu-check.md) and 2.13 (every CI run).
TESTED_MIN = (2, 11)
TESTED_BELOW = (2, 14)
ALLOW_ENV = "FLEETD_ALLOW_UNTESTED_TORCH"


def _major_minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def untested_torch(version: str | None = None) -> str | None:
    """None when torch is in the tested range (or the operator allowed another), else why not."""
    if version is None:
        try:
            version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            return "torch is not installed (fleetd needs torch for the rendezvous and the trainers)"
    found = _major_minor(version)
    if found is not None and TESTED_MIN <= found < TESTED_BELOW:
        return None
    if os.environ.get(ALLOW_ENV) == "1":
        return None
    lo, hi = ".".join(map(str, TESTED_MIN)), ".".join(map(str, TESTED_BELOW))
    return (
        f"torch {version} is outside the range fleetd is tested with (>= {lo}, < {hi}): fleetd reads "
        f"torch's private rendezvous state, which a release may change. Install a tested torch "
        f"(pip install 'torch>={lo},<{hi}'), or set {ALLOW_ENV}=1 to run with this one anyway"
    )
