"""Small calculations behind `fleetd plan`: checkpoint interval, S3 cost, interruption rates, plots."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

# The planner uses it for fleetd's own periodic checkpoints; re-exported for `fleetd plan`.
from fleetd.policy.checkpointing import young_daly_interval_s as young_daly_interval_s

if TYPE_CHECKING:  # pragma: no cover
    from fleetd.sim.result import SimResult

HOURS_PER_MONTH = 730.0


def expected_overhead_share(interval_s: float, checkpoint_stall_s: float, mtbf_s: float) -> float:
    """First-order share of time lost to checkpoints plus redone work at a given interval."""
    if interval_s <= 0:
        raise ValueError("interval must be positive")
    redo = 0.0 if math.isinf(mtbf_s) else interval_s / (2.0 * mtbf_s)
    return checkpoint_stall_s / interval_s + redo


# S3 Standard, us-east-1 public prices (first 50 TB tier).
S3_USD_PER_GB_MONTH = 0.023
S3_USD_PER_1K_PUT = 0.005
S3_USD_PER_1K_GET = 0.0004
MULTIPART_PART_MB = 64.0  # fleetd's uploader part size; each part is one PUT


@dataclass(frozen=True, slots=True)
class S3Cost:
    checkpoints: int
    put_requests: int
    storage_usd: float
    request_usd: float

    @property
    def total_usd(self) -> float:
        return self.storage_usd + self.request_usd


def s3_checkpoint_cost(
    checkpoint_gb: float, interval_s: float, run_s: float, keep: int = 3, restores: int = 0
) -> S3Cost:
    """Storage and request cost of writing a checkpoint every ``interval_s`` for ``run_s``.

    At most ``keep`` checkpoints are stored at a time (older ones deleted; DELETE is free), so
    storage is ``keep x size`` for the run's duration. Every multipart part is one PUT, plus the
    initiate/complete calls and the manifest; each restore reads every part once.
    """
    if checkpoint_gb < 0 or interval_s <= 0 or run_s < 0 or keep < 1:
        raise ValueError("size >= 0, interval > 0, run >= 0 and keep >= 1 required")
    count = int(run_s // interval_s) if math.isfinite(interval_s) else 0
    parts = max(1, math.ceil(checkpoint_gb * 1024.0 / MULTIPART_PART_MB))
    puts = count * (parts + 3)
    stored_gb = min(keep, count) * checkpoint_gb
    storage = stored_gb * S3_USD_PER_GB_MONTH * (run_s / 3600.0) / HOURS_PER_MONTH
    requests = puts / 1000.0 * S3_USD_PER_1K_PUT + restores * parts / 1000.0 * S3_USD_PER_1K_GET
    return S3Cost(count, puts, storage, requests)


def interruptions_per_hour_from_bucket(monthly_share: float) -> float:
    """A Spot Advisor bucket ("x % of instances interrupted per month") as a per-hour rate."""
    if not 0 <= monthly_share < 1:
        raise ValueError("monthly share must be in [0, 1)")
    return -math.log(1.0 - monthly_share) / HOURS_PER_MONTH


def require_matplotlib() -> ModuleType:
    """matplotlib's pyplot (non-interactive backend), or a RuntimeError saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'fleetd[plot]' (or pip install matplotlib)") from None
    return plt


def plot_results(results: Sequence[SimResult], path: Path) -> None:
    """Nodes alive, spend and progress over time, one line per policy (needs matplotlib)."""
    plt = require_matplotlib()
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for r in results:
        hours = [s.t / 3600.0 for s in r.timeline]
        axes[0].step(hours, [s.nodes for s in r.timeline], where="post", label=r.policy)
        axes[1].plot(hours, [s.spent_usd for s in r.timeline], label=r.policy)
        axes[2].plot(hours, [100.0 * s.progress for s in r.timeline], label=r.policy)
    axes[0].set_ylabel("nodes alive")
    axes[1].set_ylabel("spend (USD)")
    axes[2].set_ylabel("progress (%)")
    axes[2].set_xlabel("hours")
    axes[0].legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
