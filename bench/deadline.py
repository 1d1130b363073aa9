"""Deadline sweep: fleetd's deadline rule (the planner's own, fleetd/policy/deadline.py) against
on-demand, greedy and Uniform Progress (Can't Be Late, NSDI'24) on the bundled spot traces.

    .venv/bin/python bench/deadline.py [--offsets 50] [--seed 7]

Jobs: one node (6 h of work due in 9 h) and a fleet of 4 nodes (the same 6 h at 4 nodes' pace,
due in 9 h), on the Bamboo p3 and g4dn traces (prices: defaults.py), each started at --offsets
random offsets; changeover d in {0.05, 0.1, 0.2, 0.3, 0.5} h, the same d for every policy.
Can't Be Late's model for every policy: progress survives a loss (no checkpoint stall, every loss
with a notice). Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetd.sim.deadline import random_offsets, summary, sweep  # noqa: E402
from fleetd.sim.defaults import prices_for  # noqa: E402
from fleetd.sim.job import JobSpec  # noqa: E402
from fleetd.sim.traces import load_trace  # noqa: E402

CHANGEOVERS_H = (0.05, 0.1, 0.2, 0.3, 0.5)
JOBS = {"1 node": 1, "4 nodes": 4}
TRACES = {"p3": "p3.2xlarge", "g4dn": "g4dn.xlarge"}
WORK_H, DEADLINE_H = 6.0, 9.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--offsets", type=int, default=50)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    t0 = time.process_time()
    results: dict[str, dict] = {}
    print(f"{'case':<22} {'d h':>5}  " + "  ".join(f"{p:>24}" for p in ("on-demand", "greedy", "uniform-progress", "fleetd")))
    for trace_name, itype in TRACES.items():
        trace = load_trace(trace_name)
        spot, od = prices_for(itype)
        starts = random_offsets(trace, args.offsets, args.seed)
        for job_name, nodes in JOBS.items():
            base = JobSpec(total_steps=1.0, max_nodes=nodes, min_nodes=1, deadline_s=DEADLINE_H * 3600,
                           checkpoint_stall_s=0.0, no_notice_share=0.0)
            job = base.with_(total_steps=WORK_H * 3600 * base.throughput(nodes))
            for d_h in CHANGEOVERS_H:
                key = f"{trace_name} {job_name} d={d_h:g}h"
                s = summary(sweep(trace, job, itype, spot, od, d_h * 3600, starts))
                results[key] = s
                cells = "  ".join(
                    f"${s[p]['mean_cost_usd']:>8.2f} {s[p]['mean_savings_pct']:>5.1f}% {s[p]['misses']:>2} miss"
                    for p in ("on-demand", "greedy", "uniform-progress", "fleetd")
                )
                print(f"{trace_name + ' ' + job_name:<22} {d_h:>5g}  {cells}", flush=True)
    worse = [k for k, s in results.items() if s["fleetd"]["mean_savings_pct"] < s["uniform-progress"]["mean_savings_pct"]]
    misses = sum(s["fleetd"]["misses"] for s in results.values())
    print(f"fleetd below Uniform Progress in {len(worse)} of {len(results)} cases: {worse}; fleetd misses: {misses}")
    print(json.dumps({
        "offsets": args.offsets, "work_h": WORK_H, "deadline_h": DEADLINE_H,
        "cpu_s": round(time.process_time() - t0, 1),
        "fleetd_below_uniform_progress": worse, "fleetd_misses": misses, "cases": results,
    }))


if __name__ == "__main__":
    main()
