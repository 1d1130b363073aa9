"""`fleetd simulate --jobs N`: N jobs under one team budget against the same jobs on a split budget.

The jobs cycle through three shapes (a production run, a research run, a sweep: priorities 3, 2,
1; a fourth job repeats the first shape's priority, so equal priorities share), each a share of
the first trace's node-hours, started half an hour apart. Regions: ``--trace`` and every
``--region-trace`` (one trace each: its spot capacity), the same instance type, each further
region 10 % dearer (an assumption; say yours with the price options). The team budget is
``--budget-usd`` / ``--max-usd-per-hour`` when given, else derived from the work so it binds.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from fleetd.sim.defaults import instance_type_for_trace, prices_for
from fleetd.sim.job import JobSpec
from fleetd.sim.team import MODES, SimRegion, TeamOutcome, TeamScenario, TeamSimJob, run_team
from fleetd.sim.traces import Trace, load_trace

# (name, priority, min nodes, max nodes, share of the first trace's node-hours)
SHAPES = (("prod", 3, 4, 16, 0.25), ("research", 2, 2, 12, 0.15), ("sweep", 1, 1, 8, 0.10))
REGION_PRICE_STEP = 0.10
UNSET_BUDGET, UNSET_RATE = 1e9, 1e6  # the parser's defaults for the single-job budget options


def build(args: argparse.Namespace) -> tuple[TeamScenario, list[str]]:
    """The scenario and the lines saying where its figures come from."""
    traces: list[Trace] = [load_trace(args.trace, args.trace_values)]
    traces += [load_trace(p, args.trace_values) for p in args.region_trace or ()]
    if args.start_offset_h:
        traces = [t.window(args.start_offset_h * 3600) for t in traces]
    itype = args.instance_type or instance_type_for_trace(traces[0].name)[0]
    spot, od = prices_for(itype) if args.spot_price is None or args.on_demand_price is None else (0.0, 0.0)
    spot = args.spot_price if args.spot_price is not None else spot
    od = args.on_demand_price if args.on_demand_price is not None else od
    regions = tuple(
        SimRegion(
            t.name.removesuffix("-trace"),
            t,
            round(spot * (1 + REGION_PRICE_STEP * i), 4),
            round(od * (1 + REGION_PRICE_STEP * i), 4),
        )
        for i, t in enumerate(traces)
    )
    names = tuple(r.name for r in regions)
    capacity_node_s = traces[0].node_seconds()
    jobs = []
    for i in range(args.jobs):
        name, priority, lo, hi, share = SHAPES[i % len(SHAPES)]
        name = name if i < len(SHAPES) else f"{name}-{i // len(SHAPES) + 1}"
        deadline = None
        if i == 0 and args.deadline_h:
            deadline = args.deadline_h * 3600
        spec = JobSpec(
            total_steps=share * capacity_node_s * args.steps_per_node_s,
            steps_per_node_s=args.steps_per_node_s,
            scaling_efficiency_per_doubling=args.scaling_efficiency,
            min_nodes=lo,
            max_nodes=hi,
            checkpoint_gb=args.checkpoint_gb,
            deadline_s=deadline,
        )
        jobs.append(TeamSimJob(name, priority, spec, names, start_s=0.5 * 3600 * i))
    work_usd = sum(j.spec.total_steps / j.spec.steps_per_node_s for j in jobs) / 3600 * spot
    total = args.budget_usd if args.budget_usd != UNSET_BUDGET else round(0.9 * work_usd, 2)
    half_of_max = sum(j.spec.max_nodes for j in jobs) / 2  # so an even split still runs every job's minimum
    rate = args.max_usd_per_hour if args.max_usd_per_hour != UNSET_RATE else round(half_of_max * spot, 2)
    sc = TeamScenario(
        regions=regions,
        jobs=tuple(jobs),
        total_usd=total,
        max_usd_per_hour=rate,
        changeover_s=args.changeover_h * 3600,
    )
    sources = [
        f"regions: {', '.join(f'{r.name} (spot ${r.spot_price:.3f}/h, on-demand ${r.on_demand_price:.3f}/h)' for r in regions)}"
        f"; {itype}; each further region {REGION_PRICE_STEP:.0%} dearer (assumption)",
        f"team budget ${total:,.2f}"
        + (
            " (given)"
            if args.budget_usd != UNSET_BUDGET
            else " (derived: 90 % of the work's cost at spot, ideal scaling)"
        )
        + f", ${rate:.2f}/h"
        + (
            " (given)"
            if args.max_usd_per_hour != UNSET_RATE
            else f" (derived: {half_of_max:g} spot nodes, half the jobs' maximum sizes)"
        )
        + f"; split: 1/{len(jobs)} of each per job",
        "jobs: " + ", ".join(_describe(j) for j in jobs),
        f"changeover d {sc.changeover_s / 3600:g} h (start, resume, move); join {sc.join_s:.0f} s; "
        f"re-form {sc.reform_s:.1f} s; copy ${sc.transfer_usd_per_gb}/GB at {sc.copy_gb_per_s:g} GB/s; "
        f"one pass per {sc.tick_s:.0f} s, forecast horizon {sc.horizon_s / 3600:g} h",
    ]
    return sc, sources


def _describe(j: TeamSimJob) -> str:
    s = j.spec
    dl = f", deadline {s.deadline_s / 3600:g} h" if s.deadline_s is not None else ""
    return f"{j.name} p{j.priority} {s.min_nodes}-{s.max_nodes} nodes, {s.total_steps:,.0f} steps from {j.start_s / 3600:g} h{dl}"


def outcome_json(o: TeamOutcome) -> dict[str, Any]:
    return {
        "mode": o.mode,
        "spend_usd": round(o.spend_usd, 2),
        "budget_usd": round(o.budget_usd, 2),
        "within_budget": o.spend_usd <= o.budget_usd + 1e-6,
        "steps_done": round(o.steps_done, 1),
        "usd_per_1k_steps": None if o.usd_per_1k_steps is None else round(o.usd_per_1k_steps, 4),
        "max_burn_usd_per_hour": round(o.max_burn_usd_per_hour, 2),
        "jobs": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(j).items()} for j in o.jobs],
    }


def render(sc: TeamScenario, results: list[TeamOutcome], sources: list[str]) -> str:
    head = f"{len(sc.jobs)} jobs, {len(sc.regions)} region(s), {sc.duration_s / 3600:.1f} h"
    cols = ("arm", "spend $", "budget $", "useful steps", "$/1k steps", "done", "deadline", "pauses", "moves")
    rows = []
    for o in results:
        dl = [j.deadline_met for j in o.jobs if j.deadline_met is not None]
        rows.append(
            (
                o.mode,
                f"{o.spend_usd:,.2f}",
                f"{o.budget_usd:,.2f}",
                f"{o.steps_done:,.0f}",
                "-" if o.usd_per_1k_steps is None else f"{o.usd_per_1k_steps:.4f}",
                f"{sum(j.finished_at_h is not None for j in o.jobs)}/{len(o.jobs)}",
                "-" if not dl else f"{sum(dl)} met, {len(dl) - sum(dl)} missed",
                str(sum(j.pauses for j in o.jobs)),
                str(sum(j.moves for j in o.jobs)),
            )
        )
    per_job = [("job", *(f"{o.mode}: progress, done h, $" for o in results))]
    for i, j in enumerate(sc.jobs):
        cells = []
        for o in results:
            r = o.jobs[i]
            done = "-" if r.finished_at_h is None else f"{r.finished_at_h:.2f}"
            cells.append(f"{100 * r.steps_done / r.total_steps:.0f}%, {done}, {r.spend_usd:,.2f}")
        per_job.append((f"{j.name} (p{j.priority})", *cells))
    lines = [head, "", *_grid(cols, rows), "", *_grid(per_job[0], per_job[1:]), "", "inputs:"]
    return "\n".join(lines + [f"  {s}" for s in sources])


def _grid(cols: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*cols), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in rows)]


def run(args: argparse.Namespace) -> int:
    sc, sources = build(args)
    results = [run_team(sc, mode) for mode in MODES]
    if args.json:
        print(json.dumps({"arms": [outcome_json(o) for o in results], "inputs": sources}, indent=2))
    else:
        print(render(sc, results, sources))
    return 0
