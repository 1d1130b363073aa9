"""`fleetd logs [--node ID] [--follow] [-n N]`: the job's worker output (torchrun and its workers'
stdout and stderr) as the control host received it from every node, interleaved by time, each line
prefixed by its node. Nodes that are gone are included: a spot node's own journal goes with it,
this copy (<state_dir>/logs/<job>/, fleetd/joblogs/layout.py) stays. Reads files only: it works
whether or not the daemon runs."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, TextIO

from fleetd.commands.common import add_config_argument, load_config
from fleetd.config import DEFAULT_PATH

if TYPE_CHECKING:
    from fleetd.joblogs.reader import NodeLine

FOLLOW_POLL_S = 0.5


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p, DEFAULT_PATH)
    p.add_argument("--node", metavar="ID", help="only this node's lines (its instance id)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until Ctrl-C")
    p.add_argument("-n", "--lines", type=int, metavar="N", help="start with the last N lines only")


def render(node: str, at: str, text: str) -> str:
    return f"{node} {at} {text}"


def print_lines(lines: list[NodeLine], out: TextIO) -> None:
    for nl in lines:
        out.write(render(nl.node, nl.line.at, nl.line.text) + "\n")
    out.flush()


def run(args: argparse.Namespace) -> int:
    from fleetd.joblogs.layout import job_dir
    from fleetd.joblogs.reader import LogFollower

    cfg = load_config(args.config, "logs")
    if cfg is None:
        return 2
    if args.lines is not None and args.lines < 0:
        print("fleetd logs: -n takes a count of 0 or more", file=sys.stderr)
        return 2
    state_dir, job = cfg.fleet.state_dir, cfg.job.name
    follower = LogFollower(state_dir, job, node=args.node)
    first = follower.poll()
    if not first and not args.follow:
        print(f"fleetd logs: no lines for job {job!r} in {job_dir(state_dir, job)}", file=sys.stderr)
        return 1
    if args.lines is not None:
        first = first[max(0, len(first) - args.lines) :]
    print_lines(first, sys.stdout)
    if not args.follow:
        return 0
    try:
        while True:
            time.sleep(FOLLOW_POLL_S)
            print_lines(follower.poll(), sys.stdout)
    except KeyboardInterrupt:
        return 0
