"""`fleetd demo`: the whole loop on one machine, with no AWS account."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from fleetd.demo.story import OVERTIME_S

DEFAULT_NODES = 3
DEFAULT_DURATION_S = 150.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="nodes to keep training (default 3, or what the scenario is written for)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="S",
        help="seconds of training after the first step (default 150, or what the scenario needs; set-up adds "
        "~30); a scripted story in a job that never finishes ends once told (every event played, the "
        "whole fleet training again): this then sets the story's time scale, and a story not told "
        f"by then runs up to {OVERTIME_S:g} s longer",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--scenario",
        default=None,
        metavar="NAME",
        help="scenario: default, short, storm, calm (interruptions) or scaling (grow and shrink on measured throughput per dollar), or team (three jobs under one team budget: a pause and a resume); default: default",
    )
    g.add_argument("--trace", type=Path, metavar="PATH", help="inject notices from a spot trace's removals")
    p.add_argument(
        "--job",
        default="toy",
        metavar="NAME|FILE",
        help="the training job: toy (a plain loop with ElasticCheckpointer), hf (a Hugging Face "
        "Trainer with fleetd's callback), lightning (a Lightning Trainer with it), or a job file "
        "(e.g. deploy/examples/ddp-job/job.toml): its workdir is packed and shipped to the nodes "
        "as on EC2; default toy",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="N",
        help="the job's total steps: the demo ends when the job finishes and fleetd has released "
        "every node (--duration is then a cap); default: what the scenario says, else never",
    )
    p.add_argument(
        "--fail-at-step",
        type=int,
        default=0,
        metavar="N",
        help="make the toy job raise at step N on every rank, as a bug would: fleetd restarts it "
        "job.max_restarts times, then fails the job and releases every node",
    )
    p.add_argument("--budget", type=float, default=5.0, metavar="USD", help="budget.total_usd (default 5)")
    p.add_argument("--report", type=Path, metavar="FILE", help="also write the final report as JSON")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="DEBUGGING ONLY: plaintext, anonymous MQTT with no ACL and no node certificates "
        "(default: TLS, a certificate per node from enrolment, the fleet ACL)",
    )
    p.add_argument("--workdir", type=Path, metavar="DIR", help="keep configs and logs here (default: a temp dir)")


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from fleetd.demo.configs import DEMO_JOBS
    from fleetd.demo.report import render
    from fleetd.demo.runner import DemoOptions, run_demo
    from fleetd.demo.scenario import resolve
    from fleetd.shared.logs import configure_logging

    if args.steps is not None and args.steps < 1:
        print("--steps must be >= 1", file=sys.stderr)
        return 2
    if args.nodes is not None and args.nodes < 1:
        print("--nodes must be >= 1", file=sys.stderr)
        return 2
    if args.scenario == "team":
        return _team(args)
    try:
        scenario = resolve(args.scenario, args.trace, args.duration or DEFAULT_DURATION_S)
    except (ValueError, OSError) as exc:
        print(f"fleetd demo: {exc}", file=sys.stderr)
        return 2
    job = _job_choice(args.job)
    if job is None:
        return 2
    nodes = args.nodes or scenario.nodes or DEFAULT_NODES
    duration = args.duration or scenario.duration_s or DEFAULT_DURATION_S
    # The live view owns the terminal; the demo's own log lines go to stderr.
    configure_logging("warning" if sys.stdout.isatty() else "info", json=not sys.stderr.isatty(), stream=sys.stderr)
    if args.insecure:
        print(
            "WARNING: --insecure: the demo's MQTT is plaintext and anonymous, with no ACL. Any local "
            "process can publish for any node or send any agent a drain/shutdown command. "
            "Use it for debugging only.",
            file=sys.stderr,
        )
    opts = DemoOptions(
        nodes=nodes,
        duration_s=duration,
        scenario=scenario,
        budget_usd=args.budget,
        workdir=args.workdir,
        job=job,
        insecure=args.insecure,
        fail_at_step=args.fail_at_step,
    )
    steps = args.steps or scenario.job_steps
    if steps is not None:
        opts = dataclasses.replace(opts, steps=steps)
    elif (scenario.steps or scenario.fleet is not None) and job in DEMO_JOBS:
        # A story (scripted interruptions, or scaling) in a demo job that never finishes: it ends
        # when told (a job file's code ends when it does, so it runs on).
        opts = dataclasses.replace(opts, end_when_told=True)
    return _play(run_demo(opts), render, args)


def _play(
    demo: Coroutine[Any, Any, dict[str, Any]], render: Callable[[dict[str, Any]], str], args: argparse.Namespace
) -> int:
    """Run a demo, print its report (and write it with --report); the exit status says how it went."""
    import asyncio
    import json

    try:
        report = asyncio.run(demo)
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("fleetd demo: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    print(render(report))
    if args.report:
        args.report.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        print(f"report written to {args.report}")
    if report["failure"]:
        print(f"fleetd demo failed: {report['failure']}", file=sys.stderr)
        return 1
    return 0


def _team(args: argparse.Namespace) -> int:
    """Three jobs under one team budget (fleetd/demo/team_demo.py): its own story and report."""
    from fleetd.demo.runner import DemoOptions
    from fleetd.demo.team_demo import run_team_demo
    from fleetd.demo.team_report import render_team
    from fleetd.shared.logs import configure_logging

    configure_logging("info", json=not sys.stderr.isatty(), stream=sys.stderr)
    opts = DemoOptions(budget_usd=args.budget, workdir=args.workdir, insecure=args.insecure, live_view=False)
    return _play(run_team_demo(opts), render_team, args)


def _job_choice(value: str) -> str | None:
    """A demo job's name, or a job file's absolute path once it reads well (None: said why)."""
    from pathlib import Path

    from fleetd.demo.configs import DEMO_JOBS
    from fleetd.jobs.job_file import load_job_file
    from fleetd.shared.settings import ConfigError

    if value in DEMO_JOBS:
        return value
    path = Path(value)
    if not path.is_file():
        print(f"fleetd demo: --job {value!r} is neither {', '.join(DEMO_JOBS)} nor a job file", file=sys.stderr)
        return None
    try:
        load_job_file(path)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return None
    return str(path.resolve())
