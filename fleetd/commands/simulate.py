"""`fleetd simulate`: replay a spot trace through fleetd's planner and the baseline policies."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetd.sim.result import SimResult
    from fleetd.sim.scenario import Scenario


def add_arguments(p: argparse.ArgumentParser) -> None:
    from fleetd.sim.options import add_job_arguments, add_trace_arguments

    p.add_argument(
        "--trace",
        type=Path,
        required=True,
        help="spot trace: Bamboo/Oobleck CSV or per-tick availability JSON (detected from the "
        "content); a bundled name such as p3 or g4dn also works",
    )
    p.add_argument("--policy", default="all", help="policy name, or all (default)")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per policy")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="plot nodes, spend and progress (needs matplotlib)")
    p.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="N jobs under one team budget (fleetd/policy/team.py) against the same jobs on the budget "
        "split evenly (fleetd/sim/team.py); --budget-usd and --max-usd-per-hour are the team's",
    )
    p.add_argument(
        "--region-trace",
        type=Path,
        action="append",
        metavar="TRACE",
        help="with --jobs: another region's spot capacity (repeatable); --trace is the first region",
    )
    add_trace_arguments(p)
    add_job_arguments(p)


def run(args: argparse.Namespace) -> int:
    from fleetd.sim.options import build_scenario, sources
    from fleetd.sim.planner_tools import plot_results, require_matplotlib
    from fleetd.sim.scenario import Scenario
    from fleetd.sim.traces import TraceError, load_trace

    if args.jobs is not None:
        return _run_team(args)
    try:
        if args.plot:
            require_matplotlib()  # before minutes of simulation, not after
        trace = load_trace(args.trace, args.trace_values)
        if args.start_offset_h:
            trace = trace.window(args.start_offset_h * 3600)
        scenario = build_scenario(args, trace)
    except (TraceError, ValueError, RuntimeError) as exc:
        print(f"fleetd simulate: {exc}", file=sys.stderr)
        return 2
    names = scenario.policy_names() if args.policy == "all" else (args.policy,)
    unknown = [n for n in names if n not in Scenario.all_names()]
    if unknown:
        print(
            f"fleetd simulate: unknown policy {unknown[0]!r}; choose from all, " + ", ".join(Scenario.all_names()),
            file=sys.stderr,
        )
        return 2
    if scenario.job.deadline_s is None and any(n in ("greedy", "uniform-progress") for n in names):
        print("fleetd simulate: greedy and uniform-progress need --deadline-h and --max-nodes 1", file=sys.stderr)
        return 2
    sample = trace.duration_s / 500 if args.plot else 0.0
    results = [scenario.run(n, sample_every_s=sample) for n in names]
    if args.plot:
        plot_results(results, args.plot)
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2))
        return 0
    print(render_table(scenario, results, sources(scenario)))
    return 0


def _run_team(args: argparse.Namespace) -> int:
    from fleetd.sim import team_cli
    from fleetd.sim.traces import TraceError

    if args.jobs < 1:
        print("fleetd simulate: --jobs must be >= 1", file=sys.stderr)
        return 2
    try:
        return team_cli.run(args)
    except (TraceError, ValueError) as exc:
        print(f"fleetd simulate: {exc}", file=sys.stderr)
        return 2


def render_table(scenario: Scenario, results: Sequence[SimResult], source_rows: Sequence[tuple[str, str]]) -> str:
    job = scenario.job
    head = (
        f"trace {scenario.trace.name}: {scenario.trace.duration_s / 3600:.1f} h, "
        f"{scenario.trace.removals()} removals, mean {scenario.trace.mean_live():.1f} live nodes; "
        f"{scenario.instance_type} spot ${scenario.spot_price:.3f}/h, on-demand "
        f"${scenario.on_demand_price:.3f}/h; work {job.total_steps:,.0f} steps"
        + (f", deadline {job.deadline_s / 3600:g} h" if job.deadline_s else "")
    )
    cols = (
        "policy",
        "cost $",
        "on-demand $",
        "saved",
        "$/1k steps",
        "effective",
        "steps lost",
        "progress",
        "done h",
        "deadline",
    )
    rows = []
    for r in results:
        j = r.to_json()
        rows.append(
            (
                r.policy,
                f"{r.cost_usd:,.2f}",
                f"{r.on_demand_cost_usd:,.2f}",
                "-" if j["savings_pct"] is None else f"{j['savings_pct']:.0f}%",
                "-" if j["usd_per_1k_steps"] is None else f"{j['usd_per_1k_steps']:.3f}",
                f"{100 * r.effective_time:.1f}%",
                f"{r.steps_lost:,.0f}",
                f"{100 * r.steps_done / r.total_steps:.0f}%",
                "-" if r.finished_at_s is None else f"{r.finished_at_s / 3600:.2f}",
                {None: "-", True: "met", False: "MISSED"}[r.deadline_met],
            )
        )
    lines = [head, "", *_grid(cols, rows), ""]
    lines += _breakdown(results)
    lines += [
        "effective = useful node-time / paid node-time; on-demand $ = the same node-time at on-demand prices",
        "inputs:",
    ]
    lines += [f"  {what}: {src}" for what, src in source_rows]
    return "\n".join(lines)


def _grid(cols: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*cols), fmt.format(*("-" * w for w in widths)), *(fmt.format(*row) for row in rows)]


def _breakdown(results: Sequence[SimResult]) -> list[str]:
    """Paid node-hours not spent on useful work, by reason and cause, one column per policy."""
    labels = sorted({k for r in results for k in r.breakdown_node_s})
    if not labels:
        return []
    rows = [(k, *(_hours(r.breakdown_node_s.get(k, 0.0)) for r in results)) for k in labels]
    rows.append(("total", *(f"{sum(r.breakdown_node_s.values()) / 3600:.3f}" for r in results)))
    return ["overhead, node-hours:", *_grid(("", *(r.policy for r in results)), rows), ""]


def _hours(node_s: float) -> str:
    return f"{node_s / 3600:.3f}" if node_s > 0 else "-"
