"""`fleetd job check FILE`: read a job file and pack its workdir as `fleetd run` will, without
uploading: what will ship (files, size, the version's digest, what was left out and why), or
every problem, before a node is bought. fleetd.toml's ``[job] file`` then runs it.

`fleetd job submit FILE`: hand a job file to the running controller. It is checked and packed
here first (every problem said now, not in the daemon's log); the daemon then ships it: new nodes
boot the new version, nodes on the old one are drained (one world, one version), and a job that
had ended starts a new run (fleetd/jobs/submission.py).

`fleetd job list`: the controller's jobs with their state, last step, spend and dollars per 1,000
useful steps (the ledger's numbers, as `fleetd report` gives them). One controller runs one job
today, so the list has one row; unknown numbers print as unknown."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="job_command", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="validate a job file and show what its workdir ships (no upload)")
    check.add_argument("file", type=Path, metavar="FILE", help="the job file (e.g. deploy/examples/ddp-job/job.toml)")
    check.add_argument("--json", action="store_true", help="print the result as JSON")
    from fleetd.commands.common import add_config_argument
    from fleetd.config import DEFAULT_PATH

    submit = sub.add_parser("submit", help="hand a job file to the running controller (its nodes move to it)")
    submit.add_argument("file", type=Path, metavar="FILE", help="the job file; the daemon's user must read it")
    add_config_argument(submit, DEFAULT_PATH)
    listing = sub.add_parser("list", help="the controller's jobs: state, step, spend, $ per 1k useful steps")
    add_config_argument(listing, DEFAULT_PATH)
    listing.add_argument("--json", action="store_true", help="print the rows as JSON")


def run(args: argparse.Namespace) -> int:
    if args.job_command == "list":
        return list_jobs(args)
    if args.job_command == "submit":
        return submit(args)
    return check(args)


def submit(args: argparse.Namespace) -> int:
    import time

    from fleetd.commands.common import load_config
    from fleetd.job_record import SubmitRequest, read_job, write_submit

    cfg = load_config(args.config, "job submit")
    if cfg is None:
        return 2
    path = args.file.resolve()
    loaded = _load_and_pack(path, "submit")
    if loaded is None:
        return 2
    job, _workdir, packed = loaded
    running_name = _job_name(cfg)
    if job.name != running_name:
        print(
            f"fleetd job submit: {path} defines job {job.name!r}; fleet {cfg.fleet.name} runs {running_name!r} "
            "(one job per controller: another job is another fleet, deploy/README.md)",
            file=sys.stderr,
        )
        return 2
    state_dir = cfg.fleet.state_dir
    running = read_job(state_dir) if state_dir.exists() else None
    if running is not None and running.code_digest == packed.digest and not running.terminal:
        print(f"job {job.name}: version {packed.digest[:12]} is the one running; nothing to do")
        return 0
    try:
        where = write_submit(state_dir, SubmitRequest(file=path, digest=packed.digest, submitted_at=time.time()))
    except OSError as exc:
        print(f"fleetd job submit: cannot write the request in {state_dir}: {exc}", file=sys.stderr)
        return 1
    print(
        f"job {job.name}: version {packed.digest[:12]} submitted ({len(packed.files)} files, "
        f"{len(packed.data):,} bytes packed; {where})"
    )
    print("  fleetd ships it within a pass: new nodes boot it, nodes on the old version drain and are replaced;")
    print("  `fleetd job list` shows the version running, `journalctl -u fleetd` a refusal and why")
    return 0


def list_jobs(args: argparse.Namespace) -> int:
    from fleetd.commands.report import LedgerUnreadable, job_json, read_ledger
    from fleetd.policy import ledger

    try:
        cfg, now, events, seen = read_ledger(args.config, None)
    except LedgerUnreadable as exc:
        print(str(exc) if exc.code == 2 else f"fleetd job list: {exc}", file=sys.stderr)
        return exc.code
    summary = ledger.summarize(events, now, seen)
    job = job_json(cfg.fleet.state_dir) or {}
    steps = [e.step for e in events if isinstance(e, ledger.StepReached)]
    row = {
        "name": cfg.job.name,
        "state": job.get("state", "unknown"),
        "reason": job.get("reason", ""),
        "step": job.get("final_step") if job.get("final_step") is not None else (max(steps) if steps else None),
        "spend_usd": round(summary.spend_usd, 6),
        "usd_per_1k_steps": summary.usd_per_1k_steps,
        "code_digest": job.get("code_digest") or cfg.job.code_digest or None,
    }
    if args.json:
        print(json.dumps([row], indent=2))
        return 0
    per_1k = "unknown" if row["usd_per_1k_steps"] is None else f"${row['usd_per_1k_steps']:,.4f}"
    step = "unknown" if row["step"] is None else f"{row['step']:,}"
    print(f"{'JOB':<20} {'STATE':<11} {'STEP':>10} {'SPEND':>10} {'$/1K STEPS':>11}  VERSION")
    version = (row["code_digest"] or "unknown")[:12]
    print(
        f"{row['name']:<20} {row['state']:<11} {step:>10} {'$' + format(row['spend_usd'], ',.2f'):>10} {per_1k:>11}  {version}"
    )
    if row["reason"]:
        print(f"  {row['reason']}")
    return 0


def _job_name(cfg: Any) -> str:
    """The job the controller runs: its submitted job file's, else fleetd.toml's job file's, else
    fleetd.toml's ``[job] name`` (a job file defines the name; fleetd.toml need not repeat it)."""
    from fleetd.jobs.job_file import load_job_file
    from fleetd.jobs.submission import submitted_job
    from fleetd.shared.settings import ConfigError

    file = submitted_job(cfg).job.file
    if file is not None:
        try:
            return str(load_job_file(file)[0].name)
        except ConfigError:
            pass  # unreadable here (the daemon's user may read it): the config's name stands
    return str(cfg.job.name)


def _load_and_pack(path: Path, action: str) -> tuple[Any, Path, Any] | None:
    """The job file and its packed workdir, or None after saying what is wrong (every problem)."""
    from fleetd.jobs.job_file import load_job_file
    from fleetd.jobs.pack import PackError, pack
    from fleetd.shared.settings import ConfigError

    try:
        job, workdir = load_job_file(path)
        return job, workdir, pack(workdir)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
    except PackError as exc:
        print(f"fleetd job {action}: {exc}", file=sys.stderr)
    return None


def check(args: argparse.Namespace) -> int:
    loaded = _load_and_pack(args.file, "check")
    if loaded is None:
        return 2
    job, workdir, packed = loaded
    run_ = job.run
    out = {
        "name": job.name,
        "workdir": str(workdir),
        "run": f"-m {run_.module}" if run_.module is not None else run_.script,
        "args": list(run_.args),
        "nproc_per_node": run_.nproc_per_node,
        "setup": list(job.setup),
        "checkpoint": job.checkpoint.mode,
        "digest": packed.digest,
        "files": len(packed.files),
        "bytes": len(packed.data),
        "ignore_file": packed.ignore_file,
        "skipped_links": list(packed.skipped_links),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"job {job.name}: runs {out['run']} {' '.join(run_.args)} ({run_.nproc_per_node} per node), checkpoint: {job.checkpoint.mode}"
    )
    print(f"  setup: {'; '.join(job.setup) or 'none'}")
    print(
        f"  ships {len(packed.files)} files from {workdir}, {len(packed.data):,} bytes packed, version {packed.digest[:12]}"
    )
    print(f"  left out: {packed.ignore_file or 'no ignore file'} patterns, .git/, virtualenvs, bytecode")
    if packed.skipped_links:
        print(f"  skipped links (not shipped): {', '.join(packed.skipped_links)}")
    return 0
