"""`fleetd plan`'s engine: what a job would cost on each candidate pool, and how risky it is.

For every candidate pool the job is simulated with fleetd's policy from many random start
offsets in a spot trace of that pool (a given trace, or a synthetic one whose interruption rate
comes from the Spot Advisor bucket of the pool's instance type and region). From the runs:
expected cost, completion time percentiles, the share of runs that miss the deadline, the
on-demand share; then a recommended pool mix, the checkpoint interval (Young/Daly) and the S3
cost of the checkpoints.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from fleetd.policy.model import PoolId
from fleetd.policy.placement import prior_rate_for_bucket, region_of_zone
from fleetd.sim.planner_tools import S3Cost, s3_checkpoint_cost, young_daly_interval_s
from fleetd.sim.result import SimResult
from fleetd.sim.scenario import Scenario
from fleetd.sim.traces import BUNDLED_DIR, SyntheticPool, Trace, synthetic_trace

ADVISOR_CSV = BUNDLED_DIR / "aws_spot_advisor_gpu_snapshot_2025-06.csv"
# Spot Advisor buckets describe a month; a pool-wide reclaim wave is what a training job sees.
DEFAULT_MEAN_OUTAGE_S = 3600.0  # assumption: lost spot capacity comes back after ~1 h
MIX_WITHIN = 1.15  # pools within 15 % of the best expected cost share the load
MAX_MISS_RISK = 0.05  # a pool that misses the deadline more often than this is not recommended


@lru_cache(maxsize=1)
def _advisor_buckets() -> dict[tuple[str, str], int]:
    from fleetd.adapters.spot_advisor import load_spot_advisor

    try:
        return {(r.region, r.instance_type): r.bucket_index for r in load_spot_advisor(ADVISOR_CSV)}
    except ValueError:
        return {}


def advisor_rate_per_hour(pool: PoolId) -> float | None:
    """Interruptions per node-hour from the pool's Spot Advisor bucket (None if unknown)."""
    region = region_of_zone(pool.zone) or "us-east-1"
    bucket = _advisor_buckets().get((region, pool.instance_type))
    return None if bucket is None else prior_rate_for_bucket(bucket)


@dataclass(frozen=True, slots=True)
class PoolForecast:
    pool: PoolId
    runs: int
    interruptions_per_hour: float
    expected_cost_usd: float
    p90_cost_usd: float
    on_demand_cost_usd: float
    median_finish_h: float | None
    p90_finish_h: float | None
    miss_risk: float | None  # share of runs that missed the deadline (None: no deadline)
    incomplete: float  # share of runs that did not finish within the simulated horizon
    on_demand_share: float  # on-demand node-time / paid node-time
    effective_time: float


@dataclass(frozen=True, slots=True)
class PlanReport:
    pools: tuple[PoolForecast, ...]
    mix: tuple[tuple[PoolId, float], ...]  # recommended pools and their share of nodes
    checkpoint_interval_s: float  # fleetd: periodic insurance against unannounced losses
    checkpoint_interval_without_notice_s: float  # a job that checkpoints only periodically
    s3: S3Cost
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "pools": [
                {
                    "pool": str(f.pool),
                    "runs": f.runs,
                    "interruptions_per_node_hour": round(f.interruptions_per_hour, 6),
                    "expected_cost_usd": round(f.expected_cost_usd, 2),
                    "p90_cost_usd": round(f.p90_cost_usd, 2),
                    "on_demand_cost_usd": round(f.on_demand_cost_usd, 2),
                    "median_finish_h": f.median_finish_h,
                    "p90_finish_h": f.p90_finish_h,
                    "deadline_miss_risk": f.miss_risk,
                    "incomplete_share": round(f.incomplete, 4),
                    "on_demand_share": round(f.on_demand_share, 4),
                    "effective_time": round(f.effective_time, 4),
                }
                for f in self.pools
            ],
            "recommended_mix": [{"pool": str(p), "share": round(s, 3)} for p, s in self.mix],
            "checkpoint_interval_s": _finite(self.checkpoint_interval_s),
            "checkpoint_interval_without_fleetd_s": _finite(self.checkpoint_interval_without_notice_s),
            "s3": {
                "checkpoints": self.s3.checkpoints,
                "put_requests": self.s3.put_requests,
                "storage_usd": round(self.s3.storage_usd, 4),
                "request_usd": round(self.s3.request_usd, 4),
                "total_usd": round(self.s3.total_usd, 4),
            },
            "notes": list(self.notes),
        }


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else round(x, 1)


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def forecast_pool(base: Scenario, pool: PoolId, trace: Trace, rate: float, offsets: int, seed: int) -> PoolForecast:
    job = base.job
    horizon = (3 * job.deadline_s) if job.deadline_s else None
    span = trace.duration_s - (horizon or 0.0)
    if span <= 0:
        span = trace.duration_s * 0.5  # short trace: starts in its first half, runs to its end
    rng = random.Random(seed)
    sc = replace(base, trace=trace, instance_type=pool.instance_type)
    results: list[SimResult] = []
    for _ in range(offsets):
        start = rng.uniform(0.0, span)
        results.append(sc.run("fleetd", trace=trace.window(start)))
    done = [r for r in results if r.completed]
    finish = [r.finished_at_s / 3600.0 for r in done if r.finished_at_s is not None]
    paid = sum(r.paid_node_s for r in results)
    misses = None
    if job.deadline_s is not None:
        misses = sum(1 for r in results if not r.deadline_met) / len(results)
    return PoolForecast(
        pool=pool,
        runs=len(results),
        interruptions_per_hour=rate,
        expected_cost_usd=statistics.fmean(r.cost_usd for r in results),
        p90_cost_usd=_pct([r.cost_usd for r in results], 0.9),
        on_demand_cost_usd=statistics.fmean(r.on_demand_cost_usd for r in results),
        median_finish_h=round(statistics.median(finish), 3) if finish else None,
        p90_finish_h=round(_pct(finish, 0.9), 3) if finish else None,
        miss_risk=None if misses is None else round(misses, 4),
        incomplete=1 - len(done) / len(results),
        on_demand_share=sum(r.on_demand_node_s for r in results) / paid if paid else 0.0,
        effective_time=sum(r.useful_node_s for r in results) / paid if paid else 0.0,
    )


def synthetic_pool_trace(pool: PoolId, nodes: int, rate_per_node_hour: float, duration_s: float, seed: int) -> Trace:
    """Pool-wide reclaim waves at the pool's per-node rate (all nodes go together 90 % of the
    time, matching real traces), capacity back after ~1 h."""
    spec = SyntheticPool(str(pool.zone), nodes, rate_per_node_hour, DEFAULT_MEAN_OUTAGE_S, 0.9)
    return synthetic_trace([spec], duration_s, seed=seed, name=f"synthetic-{pool}")


def plan_job(
    base: Scenario,
    pools: Sequence[tuple[PoolId, float, float]],
    traces: dict[PoolId, Trace] | None = None,
    offsets: int = 200,
    seed: int = 0,
    keep_checkpoints: int = 3,
    checkpoint_stall_s: float | None = None,
) -> PlanReport:
    """``pools``: (pool, spot price, on-demand price). ``traces``: a real trace per pool (else
    synthetic from the Spot Advisor rate)."""
    job = base.job
    notes: list[str] = []
    forecasts: list[PoolForecast] = []
    run_h = (job.deadline_s or job.total_steps / job.throughput(job.max_nodes)) / 3600.0
    for i, (pool, spot, od) in enumerate(pools):
        trace = (traces or {}).get(pool)
        rate = advisor_rate_per_hour(pool)
        if trace is not None:
            rate = trace.removals() / max(1e-9, trace.node_seconds() / 3600.0)
        elif rate is not None:
            notes.append(
                "interruption rates are Spot Advisor's monthly buckets; real traces are far more "
                "hostile (p3: ~0.6 per node-hour), try --trace-for POOL=p3 for a stress case"
            )
        else:
            notes.append(f"{pool}: not in the Spot Advisor table; assuming its worst bucket (>20 %)")
            rate = prior_rate_for_bucket(4)
        if trace is None:
            # Long enough for every start offset plus a 3x-deadline horizon.
            duration = max(30 * 86400.0, 6 * run_h * 3600.0)
            trace = synthetic_pool_trace(pool, job.max_nodes, rate, duration, seed + i)
        sc = replace(base, spot_price=spot, on_demand_price=od)
        forecasts.append(forecast_pool(sc, pool, trace, rate, offsets, seed + i))

    eligible = [f for f in forecasts if f.miss_risk is None or f.miss_risk <= MAX_MISS_RISK]
    if not eligible:
        notes.append(f"every pool misses the deadline more than {MAX_MISS_RISK:.0%} of the time")
        eligible = sorted(forecasts, key=lambda f: (f.miss_risk or 0.0, f.expected_cost_usd))[:1]
    best = min(f.expected_cost_usd for f in eligible)
    chosen = [f for f in eligible if f.expected_cost_usd <= best * MIX_WITHIN]
    weights = [1.0 / max(f.expected_cost_usd, 1e-9) for f in chosen]
    mix = tuple((f.pool, w / sum(weights)) for f, w in zip(chosen, weights, strict=True))

    # fleetd checkpoints on every notice; periodic checkpoints only insure against the losses
    # that come without one. A job without fleetd needs them against every loss.
    rate = sum(f.interruptions_per_hour * s for f, s in zip(chosen, (s for _, s in mix), strict=True))
    fleet_rate = rate * job.max_nodes
    mtbf_all = 3600.0 / fleet_rate if fleet_rate > 0 else math.inf
    mtbf_silent = 3600.0 / (fleet_rate * job.no_notice_share) if fleet_rate * job.no_notice_share > 0 else math.inf
    stall = job.checkpoint_stall_s if checkpoint_stall_s is None else checkpoint_stall_s
    interval = young_daly_interval_s(stall, mtbf_silent)
    interval_without = young_daly_interval_s(stall, mtbf_all)
    max_age = base.fleetd_config().rebalance.max_checkpoint_age_s
    if interval > max_age:
        notes.append(f"Young/Daly interval ({interval:.0f} s) capped at rebalance.max_checkpoint_age_s {max_age:.0f} s")
        interval = max_age
    finish = [f.median_finish_h for f in chosen if f.median_finish_h is not None]
    run_s = (statistics.fmean(finish) if finish else run_h) * 3600.0
    s3 = s3_checkpoint_cost(job.checkpoint_gb, max(interval, 1.0), run_s, keep=keep_checkpoints)
    return PlanReport(tuple(forecasts), mix, interval, interval_without, s3, tuple(notes))
