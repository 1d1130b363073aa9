"""Generate bench/traces/waves-7d.csv: a 7-day reclaim-wave trace of one 4-node spot pool.

    .venv/bin/python bench/traces/make_waves.py   # rewrites waves-7d.csv (deterministic, seed 15)

Why: bench/traces/wave.csv is 60 s long (the demo's storm), so a sweep's start offsets all fall
in its first minute and are one scenario. This trace keeps its shape (a 4-node pool whose
reclaims take several nodes at once) over 7 days, so 50 offsets are distinct windows.

Synthetic, calibrated to the Bamboo p3 trace (fleetd/data/traces/p3-trace.csv, MIT; measured by
``calibration()`` below, printed when this script runs):
- losses per node-hour: removals / node-hours of the p3 trace (0.61);
- wave share: share of removal instants (within 120 s) that take more than one node (0.70);
- mean outage: Little's law on p3, missing nodes (max live - mean live) / removal rate (0.54 h).
No public trace with these properties over days exists in ../shared/traces (only the two
~11 h Bamboo traces and AWS's monthly interruption buckets, which are far calmer: a 4-node pool
at AWS's worst bucket, >20 % a month, would see about one reclaim in a week).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fleetd.sim.traces import REMOVE, SyntheticPool, Trace, load_trace, synthetic_trace  # noqa: E402

OUT = Path(__file__).resolve().parent / "waves-7d.csv"
POOL_NODES = 4
DAYS = 7
SEED = 15


def calibration(trace: Trace) -> dict[str, float]:
    removals = sorted(e.t for e in trace.events if e.kind == REMOVE)
    waves: list[list[float]] = []
    for t in removals:
        if waves and t - waves[-1][-1] <= 120.0:
            waves[-1].append(t)
        else:
            waves.append([t])
    node_h = trace.node_seconds() / 3600.0
    rate_h = len(removals) / (trace.duration_s / 3600.0)
    return {
        "losses_per_node_h": len(removals) / node_h,
        "wave_share": sum(1 for w in waves if len(w) > 1) / len(waves),
        "mean_outage_s": (trace.max_live - trace.mean_live()) / rate_h * 3600.0,
    }


def main() -> None:
    cal = calibration(load_trace("p3"))
    # A pool-wide interruption takes every live node of the pool, a single one takes one; with
    # the pool mostly full, losses per hour ~ rate x (share x nodes + (1 - share)).
    share = cal["wave_share"]
    per_interruption = share * POOL_NODES + (1 - share)
    rate = cal["losses_per_node_h"] * POOL_NODES / per_interruption
    pool = SyntheticPool("waves", POOL_NODES, rate, cal["mean_outage_s"], share)
    trace = synthetic_trace([pool], DAYS * 86400.0, seed=SEED, name="waves-7d")
    lines = [f"{round(e.t * 1000)},{e.kind},{e.node}" for e in trace.events]
    OUT.write_text("\n".join(lines) + "\n")
    print({k: round(v, 3) for k, v in cal.items()}, f"interruptions/h {rate:.3f}")
    print(
        f"{OUT.name}: {len(trace.events)} events, mean live {trace.mean_live():.2f} of {POOL_NODES}, "
        f"removals/h {trace.removals() / (trace.duration_s / 3600):.2f}"
    )


if __name__ == "__main__":
    main()
