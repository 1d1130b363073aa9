"""`fleetd` command line. Each subcommand lives in fleetd/commands/<name>.py with
``add_arguments(parser)`` and ``run(args) -> int``; heavy imports stay inside ``run``."""

from __future__ import annotations

import argparse
import importlib
import sys

from fleetd import __version__

# name -> (module, one-line help). Order is the order --help shows.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("fleetd.commands.run", "run the controller daemon (reconcile loop, intake, metrics)"),
    "rendezvous": ("fleetd.commands.rendezvous", "host the torchrun c10d rendezvous store (own long-lived process)"),
    "demo": ("fleetd.commands.demo", "run the whole loop locally: moto cloud, broker, agents, real torchrun"),
    "simulate": ("fleetd.commands.simulate", "replay a spot trace through the planner and compare policies"),
    "plan": ("fleetd.commands.plan", "what-if planner: cost, completion time and risk for a job"),
    "report": ("fleetd.commands.report", "cost and goodput report from fleetd's state"),
    "pools": ("fleetd.commands.pools", "the pools a config would bid on in a region: GPUs, prices, why excluded"),
    "status": ("fleetd.commands.status", "nodes, rendezvous round and budget, from fleetd's state"),
    "doctor": ("fleetd.commands.doctor", "check the account, this host and the config before `fleetd run`"),
    "job": (
        "fleetd.commands.job",
        "jobs: check a job file (job check FILE), hand one to the controller (job submit FILE), list the jobs with state and spend (job list)",
    ),
    "team": (
        "fleetd.commands.team",
        "one budget over several jobs: team run (the team's loop), team plan, team status",
    ),
    "cancel": ("fleetd.commands.cancel", "stop the job for good: checkpoint, then release every node"),
    "logs": ("fleetd.commands.logs", "the job's worker output from every node, gone ones too (--follow)"),
    "config": ("fleetd.commands.config", "configuration tools (config check)"),
    "ca": ("fleetd.commands.ca", "the fleet CA for the broker and node certificates (ca init)"),
    "iam": ("fleetd.commands.iam", "the deploy/iam policies with this fleet's bucket, prefix, queue and table"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetd",
        description="Spot-fleet orchestration for elastic GPU training on EC2.",
    )
    parser.add_argument("--version", action="version", version=f"fleetd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    mod = importlib.import_module(args._module)
    try:
        return int(mod.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
