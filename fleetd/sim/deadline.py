"""Deadline experiments shared by the test suite, bench/sim.py and bench/deadline.py: one job
started at many offsets of a trace, every policy with the same trace window, prices and
changeover d (like for like).

- `deadline_runs`: Can't Be Late (NSDI'24)'s tight setting: one node, 48 h of work due in 52 h,
  on a synthetic spot pool available ~77 % of the time (interruptions ~0.1/h, outages ~3 h).
- `sweep`: any trace and job, at given start offsets (bench/deadline.py's sweep).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable
from typing import Any

from fleetd.sim import defaults as d
from fleetd.sim.engine import PROBE
from fleetd.sim.job import JobSpec
from fleetd.sim.result import SimResult
from fleetd.sim.scenario import Scenario
from fleetd.sim.traces import SyntheticPool, Trace, synthetic_trace


def sweep(
    trace: Trace,
    job: JobSpec,
    instance_type: str,
    spot_price: float,
    on_demand_price: float,
    changeover_s: float,
    offsets: Iterable[float],
    capacity_signal: str = PROBE,
) -> dict[str, list[SimResult]]:
    """Every deadline policy on ``trace`` started at each offset, all with changeover ``d`` and
    the same capacity discovery (fleetd/sim/engine.py)."""
    sc = Scenario(
        trace,
        job,
        instance_type,
        spot_price,
        on_demand_price,
        changeover_s=changeover_s,
        capacity_signal=capacity_signal,
    )
    runs: dict[str, list[SimResult]] = {}
    for start in offsets:
        window = trace.window(start)
        for name in sc.policy_names():
            runs.setdefault(name, []).append(sc.run(name, trace=window))
    return runs


def random_offsets(trace: Trace, count: int, seed: int, keep_s: float = 0.0) -> list[float]:
    rng = random.Random(seed)
    return [rng.uniform(0, max(1.0, trace.duration_s - keep_s)) for _ in range(count)]


def summary(runs: dict[str, list[SimResult]]) -> dict[str, dict[str, Any]]:
    """Mean cost, savings against on-demand-only, misses and on-demand hours per policy."""
    od = statistics.fmean(r.cost_usd for r in runs["on-demand"]) if "on-demand" in runs else None
    out = {}
    for name, rs in runs.items():
        cost = statistics.fmean(r.cost_usd for r in rs)
        out[name] = {
            "mean_cost_usd": round(cost, 3),
            # Cost per useful step (a missed deadline may still finish later; steps done count).
            "usd_per_1k_steps": round(statistics.fmean(1000.0 * r.cost_usd / max(r.steps_done, 1e-9) for r in rs), 5),
            "mean_savings_pct": round(100.0 * (1 - cost / od), 2) if od else None,
            "misses": sum(1 for r in rs if not r.deadline_met),
            "mean_on_demand_node_h": round(statistics.fmean(r.on_demand_node_s for r in rs) / 3600, 3),
            "runs": len(rs),
        }
    return out


def deadline_runs(
    offsets: int, seed: int = 5, changeover_s: float = d.CHANGEOVER_S.value
) -> dict[str, list[SimResult]]:
    trace = synthetic_trace([SyntheticPool("us-east-1a", 1, 0.1, 3 * 3600.0, 1.0)], 90 * 86400.0, seed=11)
    job = JobSpec(total_steps=48 * 3600.0, deadline_s=52 * 3600.0, checkpoint_stall_s=0.0, no_notice_share=0.0)
    starts = random_offsets(trace, offsets, seed, keep_s=3 * 52 * 3600.0)
    return sweep(trace, job, "p3.2xlarge", 0.612, 3.06, changeover_s, starts)
