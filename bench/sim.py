"""Simulator speed and headline numbers. Prints a table; the last line is one JSON object.

    .venv/bin/python bench/sim.py [--offsets 200]

- speed: wall time per policy for a 24 h trace (the Bamboo p3 trace repeated to 24 h: ~350
  removals, up to 32 nodes) and for the 11.4 h p3 trace itself;
- effective time per policy on p3 (defaults of `fleetd simulate`), and fleetd's with the
  variants that show where its overhead comes from;
- Can't Be Late's comparison on synthetic single-node traces over random start offsets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetd.sim.deadline import deadline_runs  # noqa: E402
from fleetd.sim.defaults import prices_for  # noqa: E402
from fleetd.sim.job import JobSpec  # noqa: E402
from fleetd.sim.scenario import Scenario, ideal_steps  # noqa: E402
from fleetd.sim.traces import ADD, REMOVE, Trace, TraceEvent, load_trace  # noqa: E402


def repeat_to(trace: Trace, hours: float) -> Trace:
    """The trace played again and again (each copy's nodes renamed) up to ``hours``."""
    events: list[TraceEvent] = []
    copy = 0
    end = hours * 3600.0
    while copy * trace.duration_s < end:
        shift = copy * trace.duration_s
        live: set[str] = set()
        for ev in trace.events:
            t = ev.t + shift
            if t > end:
                break
            name = f"{ev.node}.{copy}"
            events.append(TraceEvent(t, ev.kind, name, ev.pool))
            (live.add if ev.kind == ADD else live.discard)(name)
        boundary = min(end, shift + trace.duration_s)
        if boundary < end:  # the next copy starts afresh
            events.extend(TraceEvent(boundary, REMOVE, n, "trace") for n in sorted(live))
        copy += 1
    events.sort(key=lambda e: e.t)
    return Trace(f"{trace.name}x{hours:g}h", tuple(events), end, trace.source)


def p3_scenario(trace: Trace, **kw) -> Scenario:
    job = JobSpec(total_steps=1.0, max_nodes=trace.max_live)
    job = job.with_(total_steps=0.8 * ideal_steps(trace, job))
    spot, od = prices_for("p3.2xlarge")
    return Scenario(trace, job, "p3.2xlarge", spot, od, **kw)


def timed_runs(sc: Scenario, repeats: int = 3) -> dict[str, float]:
    """Best of ``repeats`` CPU seconds per policy (CPU time: the box is shared, wall time is not
    this process's alone)."""
    out = {}
    for name in sc.policy_names():
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            sc.run(name)
            best = min(best, time.process_time() - t0)
        out[name] = round(best, 4)
    return out


def deadline_comparison(offsets: int) -> dict:
    runs = deadline_runs(offsets)
    return {
        name: {
            "mean_cost_usd": round(statistics.fmean(r.cost_usd for r in rs), 2),
            "misses": sum(1 for r in rs if not r.deadline_met),
            "mean_on_demand_h": round(statistics.fmean(r.on_demand_node_s for r in rs) / 3600, 2),
        }
        for name, rs in runs.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--offsets", type=int, default=200)
    args = ap.parse_args()
    p3 = load_trace("p3")
    day = repeat_to(p3, 24.0)
    speed_24h = timed_runs(p3_scenario(day))
    speed_p3 = timed_runs(p3_scenario(p3))
    print(f"24 h trace ({day.removals()} removals, max {day.max_live} nodes): CPU seconds per policy {speed_24h}")
    print(f"p3 trace (11.4 h): CPU seconds per policy {speed_p3}")

    base = p3_scenario(p3)
    effective = {name: round(base.run(name).effective_time, 4) for name in base.policy_names()}
    yd = base.fleetd_config()
    yd = yd.model_copy(update={"rebalance": yd.rebalance.model_copy(update={"young_daly_checkpoints": True})})
    variants = {
        "daemon defaults": base,
        "drained nodes never report that they left": replace(base, leaving_signal=False),
        "on-demand to hold the fleet size (hold_size)": replace(base, on_demand="hold_size"),
        "Young/Daly periodic checkpoints": replace(base, base_config=yd),
        "sharded state: a loss without notice rolls back": replace(base, salvage_loss_s=None),
        "checkpoint stall 15 s (default 5 s)": replace(base, job=base.job.with_(checkpoint_stall_s=15.0)),
        "a join stalls the running ranks for a leave's round only": replace(base, join_reform_s=base.reform_s),
    }
    fleetd_variants = {}
    fleetd_overheads = {}
    for k, v in variants.items():
        r = v.run("fleetd")
        fleetd_variants[k] = round(r.effective_time, 4)
        fleetd_overheads[k] = {n: round(s / 3600.0, 2) for n, s in sorted(r.breakdown_node_s.items())}
    for share in (0.0, 0.01, 0.2):
        job = base.job.with_(no_notice_share=share)
        fleetd_variants[f"{share:.0%} losses unannounced (default 5 %)"] = round(
            replace(base, job=job).run("fleetd").effective_time, 4
        )
    print(f"p3 effective time: {effective}")
    print(f"fleetd on p3, variants: {fleetd_variants}")
    print(f"fleetd on p3, lost node-hours by cause: {fleetd_overheads}")

    deadline = deadline_comparison(args.offsets)
    print(f"deadline jobs (48 h of work, 52 h deadline, {args.offsets} offsets): {deadline}")
    print(
        json.dumps(
            {
                "cpu_seconds_per_policy_24h_trace": speed_24h,
                "cpu_seconds_per_policy_p3": speed_p3,
                "p3_effective_time": effective,
                "p3_fleetd_variants": fleetd_variants,
                "p3_fleetd_overhead_node_hours": fleetd_overheads,
                "deadline": deadline,
            }
        )
    )


if __name__ == "__main__":
    main()
