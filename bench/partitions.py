"""Partitions measured on the real stack: what a cut costs, and the numbers behind [loss].

One job of 3 nodes (real mosquitto, torchrun on CPU/gloo, moto as EC2, `fleetd run`), cut for
real with iptables in a private network namespace (tests/harness/partitions.py):

- broker only for 60 s: terminated? re-formed?
- store only on the rank-0 node for 1, 3 and 6 s: how long the job pauses (rank 0 reads the store
  every step), and whether it re-forms;
- store only on another node for 20 s: how long gloo collectives go on without that node's store
  connection (they do not use it);
- broker and store for good on a non-rank-0 node (EC2 still says running): seconds until fleetd
  terminates it and until the survivors train again: the bound DESIGN.md documents;
- healthy heartbeat gaps under this load (2 cores, 3 trainers, fleetd, moto, broker): what
  loss.dead_after_s must stay above.

    nice .venv/bin/python bench/partitions.py [--phases ...]    # ~7 min; last line: one JSON object
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness.netfault import run_in_private_netns  # noqa: E402

DEFAULT = "broker:60,store:1@rank0,store:3@rank0,store:6@rank0,store:20@other,both@other"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phases", default=DEFAULT)
    p.add_argument("--nodes", type=int, default=3)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fleetd-bench-partitions-"))
    out = work / "result.json"
    res = run_in_private_netns(
        [
            sys.executable,
            "-m",
            "tests.harness.partitions",
            "--phases",
            args.phases,
            "--nodes",
            str(args.nodes),
            "--workdir",
            str(work / "run"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if res.returncode != 0 or not out.exists():
        print(res.stdout[-3000:], res.stderr[-3000:], file=sys.stderr)
        print(json.dumps({"error": f"scenario exited {res.returncode}", "workdir": str(work)}))
        return 1
    r = json.loads(out.read_text())
    for ph in r.get("phases", []):
        where = "rank-0 node" if ph["was_rank0"] else "other node"
        line = (
            f"{ph['kind']:>6} cut {ph['cut_s']:>6.1f} s on the {where}: re-forms {ph['reforms']}, "
            f"terminated {len(ph['terminated'])}, longest step pause {ph['longest_step_pause_s']} s"
        )
        if ph["kind"] == "both":
            line += (
                f", terminated after {ph['terminated_after_s']} s, survivors training again after "
                f"{ph['survivors_training_after_s']} s"
            )
        print(line)
    print(
        f"healthy heartbeat gaps: {r.get('healthy_heartbeat_gaps')}; healthy step gap max "
        f"{r.get('healthy_step_max_gap_s')} s"
    )
    summary = {
        "bench": "partitions",
        "nodes": r.get("nodes"),
        "phases": [
            {
                k: ph[k]
                for k in (
                    "kind",
                    "cut_s",
                    "was_rank0",
                    "reforms",
                    "terminated",
                    "longest_step_pause_s",
                    "steering_tolerated_stale",
                    "broker_timed_out_clients",
                )
            }
            | (
                {
                    "terminated_after_s": ph["terminated_after_s"],
                    "survivors_training_after_s": ph["survivors_training_after_s"],
                }
                if ph["kind"] == "both"
                else {}
            )
            for ph in r.get("phases", [])
        ],
        "healthy_heartbeat_gaps": r.get("healthy_heartbeat_gaps"),
        "healthy_step_max_gap_s": r.get("healthy_step_max_gap_s"),
        "error": r.get("error"),
        "workdir": r.get("workdir"),
    }
    print(json.dumps(summary))
    return 0 if not r.get("error") else 1


if __name__ == "__main__":
    sys.exit(main())
