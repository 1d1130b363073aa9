"""The Can't Be Late (NSDI'24) deadline experiment: one tight single-node job (48 h of work due in
52 h) on a synthetic spot pool that is available about 77 % of the time (interruptions ~0.1/h,
outages ~3 h), started at many random offsets. Shared by the test suite and bench/sim.py."""

from __future__ import annotations

import random
from dataclasses import replace

from fleetd.sim.result import SimResult
from fleetd.sim.job import JobSpec
from fleetd.sim.scenario import Scenario
from fleetd.sim.traces import SyntheticPool, synthetic_trace

# Uniform Progress given fleetd's (smaller) changeover overhead, for a like-for-like comparison.
UP_SAME_OVERHEAD = "uniform-progress-same-d"


def deadline_runs(offsets: int, seed: int = 5) -> dict[str, list[SimResult]]:
    trace = synthetic_trace([SyntheticPool("us-east-1a", 1, 0.1, 3 * 3600.0, 1.0)], 90 * 86400.0, seed=11)
    job = JobSpec(total_steps=48 * 3600.0, deadline_s=52 * 3600.0, checkpoint_stall_s=0.0, no_notice_share=0.0)
    sc = Scenario(trace, job, "p3.2xlarge", spot_price=0.612, on_demand_price=3.06)
    same_d = replace(sc, changeover_s=sc.fleetd_changeover_s)
    rng = random.Random(seed)
    runs: dict[str, list[SimResult]] = {}
    for _ in range(offsets):
        window = trace.window(rng.uniform(0, trace.duration_s - 3 * job.deadline_s))
        for name in sc.policy_names():
            runs.setdefault(name, []).append(sc.run(name, trace=window))
        runs.setdefault(UP_SAME_OVERHEAD, []).append(same_d.run("uniform-progress", trace=window))
    return runs
