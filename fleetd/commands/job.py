"""`fleetd job check FILE`: read a job file and pack its workdir as `fleetd run` will, without
uploading: what will ship (files, size, the version's digest, what was left out and why), or
every problem, before a node is bought. fleetd.toml's ``[job] file`` then runs it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="job_command", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="validate a job file and show what its workdir ships (no upload)")
    check.add_argument("file", type=Path, metavar="FILE", help="the job file (e.g. deploy/examples/ddp-job/job.toml)")
    check.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    from fleetd.jobs.job_file import load_job_file
    from fleetd.jobs.pack import PackError, pack
    from fleetd.protocol.settings import ConfigError

    try:
        job, workdir = load_job_file(args.file)
        packed = pack(workdir)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return 2
    except PackError as exc:
        print(f"fleetd job check: {exc}", file=sys.stderr)
        return 2
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
