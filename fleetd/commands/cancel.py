"""`fleetd cancel [--reason TEXT]`: stop the job for good. The controller takes a coordinated
checkpoint, makes it durable, then terminates every node; the job ends CANCELLED
(fleetd/policy/job_state.py). The request is a file in the fleet's state directory, so it reaches
a daemon that is restarting too; `fleetd status` shows the job's state."""

from __future__ import annotations

import argparse
import sys
import time

from fleetd.commands.common import add_config_argument, load_config
from fleetd.config import DEFAULT_PATH


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p, DEFAULT_PATH)
    p.add_argument("--reason", default="requested by the operator", help="recorded in the job's state")


def run(args: argparse.Namespace) -> int:
    from fleetd.job_record import CancelRequest, read_job, write_cancel

    cfg = load_config(args.config, "cancel")
    if cfg is None:
        return 2
    state_dir = cfg.fleet.state_dir
    job = read_job(state_dir) if state_dir.exists() else None
    if job is not None and job.terminal:
        print(f"fleet {cfg.fleet.name}: the job already ended ({job.state}): nothing to cancel", file=sys.stderr)
        return 1
    try:
        path = write_cancel(state_dir, CancelRequest(reason=args.reason, requested_at=time.time()))
    except OSError as exc:
        print(f"cannot write the cancel request in {state_dir}: {exc}", file=sys.stderr)
        return 1
    print(f"fleet {cfg.fleet.name}: cancel requested ({path}); `fleetd status` shows the job's state")
    return 0
