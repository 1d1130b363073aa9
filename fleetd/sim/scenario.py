"""A runnable comparison: a trace, a job, prices and the policies to compare.

`fleetd simulate`, `fleetd plan`, bench/sim*.py and the tests build their runs here, so they all
use the same defaults (fleetd/sim/defaults.py) and the same policy set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from fleetd.config import BudgetConfig, CapacityConfig, FleetConfig, FleetdConfig
from fleetd.policy.model import PoolId
from fleetd.sim import defaults as d
from fleetd.sim.deadline_fleet import FleetGreedy, FleetUniformProgress
from fleetd.sim.engine import PROBE, Policy, simulate
from fleetd.sim.fleetd_policy import FleetdPolicy
from fleetd.sim.job import JobSpec
from fleetd.sim.planner_tools import young_daly_interval_s
from fleetd.sim.policies import (
    CheckpointRestart,
    Greedy,
    OnDemandOnly,
    TorchrunElastic,
    UniformProgress,
)
from fleetd.sim.result import SimResult
from fleetd.sim.traces import Trace

CLUSTER_POLICIES = ("on-demand", "checkpoint-restart", "torchrun-default", "fleetd")
DEADLINE_POLICIES = ("on-demand", "greedy", "uniform-progress", "fleetd")


@dataclass(frozen=True)
class Scenario:
    trace: Trace
    job: JobSpec
    instance_type: str
    spot_price: float
    on_demand_price: float
    budget_usd: float = 1e9
    max_usd_per_hour: float = 1e6
    on_demand: str = "deadline"  # fleetd's capacity.on_demand: never | deadline | hold_size
    reform_s: float = d.FLEETD_REFORM_S.value  # a leave's round (and a silent loss's, once poked)
    join_reform_s: float = d.FLEETD_JOIN_REFORM_S.value  # a join's round, for every elastic policy
    torchrun_reform_s: float = d.TORCHRUN_REFORM_S.value
    restart_recovery_s: float = d.CHECKPOINT_RESTART_RECOVERY_S.value
    # Deadline jobs: buying a node until it trains (d), the same for every policy.
    changeover_s: float = d.CHANGEOVER_S.value
    on_demand_nodes: int | None = None  # None: the trace's time-average live nodes
    # Baselines' periodic checkpoint interval; None: Young/Daly for the rate of the events that
    # make each baseline roll back on this trace (the best any fixed period can do).
    periodic_checkpoint_s: float | None = None
    # fleetd: a drained node's agent reports that its trainer exited (registry left_at) and the
    # planner terminates it at once (DESIGN.md step 4). False: billed until reclaimed.
    leaving_signal: bool = True
    # fleetd after a loss without notice: the survivors save the step they completed and only
    # the step in flight (this many seconds) is lost; None: sharded state, roll back instead.
    salvage_loss_s: float | None = d.SALVAGE_STEP_LOSS_S.value
    # The operator's fleetd config (planner settings: scaling, rebalance, thresholds); fleet
    # size, instance type, on-demand permission and budget come from the scenario.
    base_config: FleetdConfig | None = None
    # How every policy learns that spot capacity returned (fleetd/sim/engine.py): "probe" (by a
    # launch attempt, retried after fleetd's capacity-error TTL) or "instant" (the old oracle).
    capacity_signal: str = PROBE
    seed: int = 0
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def deadline_mode(self) -> bool:
        return self.job.deadline_s is not None

    def policy_names(self) -> tuple[str, ...]:
        return DEADLINE_POLICIES if self.deadline_mode else CLUSTER_POLICIES

    def fleetd_config(self) -> FleetdConfig:
        base = self.base_config or FleetdConfig(
            fleet=FleetConfig(), capacity=CapacityConfig(instance_types=(self.instance_type,)), budget=BudgetConfig()
        )
        return base.model_copy(
            update={
                "fleet": base.fleet.model_copy(
                    update={"min_nodes": self.job.min_nodes, "max_nodes": self.job.max_nodes}
                ),
                "capacity": base.capacity.model_copy(
                    update={"instance_types": (self.instance_type,), "on_demand": self.on_demand}
                ),
                "job": base.job.model_copy(update=self._deadline_job()),
                "budget": base.budget.model_copy(
                    update={"total_usd": self.budget_usd, "max_usd_per_hour": self.max_usd_per_hour}
                ),
                # The operator tells fleetd the job's save time (Young/Daly's delta).
                "rebalance": base.rebalance.model_copy(update={"checkpoint_stall_s": self.job.checkpoint_stall_s}),
            }
        )

    def _deadline_job(self) -> dict[str, Any]:
        """job.deadline / total_steps / changeover_s on the simulator's clock (virtual seconds
        from 0, so the deadline is that many seconds after the epoch)."""
        if self.job.deadline_s is None:
            return {}
        return {
            "deadline": datetime.fromtimestamp(self.job.deadline_s, UTC),
            "total_steps": math.ceil(self.job.total_steps),
            "changeover_s": self.changeover_s,
            # The job's pace, as the baselines know it (they count work in seconds): fleetd uses
            # it only until it has measured the throughput itself.
            "steps_per_s": self.job.throughput(self.job.max_nodes),
        }

    def make_policy(self, name: str) -> Policy:
        job = self.job
        if name == "on-demand":
            nodes = self.on_demand_nodes or max(1, min(job.max_nodes, round(self.trace.mean_live())))
            return OnDemandOnly(nodes if not self.deadline_mode else job.max_nodes, job.periodic_checkpoint_s)
        if name == "checkpoint-restart":
            return CheckpointRestart(self.restart_recovery_s, self.baseline_interval_s(removals_only=True))
        if name == "torchrun-default":
            return TorchrunElastic(self.torchrun_reform_s, self.baseline_interval_s(removals_only=False))
        if name == "greedy":
            if job.max_nodes == 1:
                return Greedy(self.changeover_s)
            return FleetGreedy(self.changeover_s, self.reform_s, self.join_reform_s)
        if name == "uniform-progress":
            if job.max_nodes == 1:
                return UniformProgress(self.changeover_s)
            return FleetUniformProgress(self.changeover_s, self.reform_s, self.join_reform_s)
        if name == "fleetd":
            pool = PoolId(self.instance_type, self.trace.pools()[0] if self.trace.pools() else "trace")
            if self.deadline_mode:
                assert job.deadline_s is not None
                return FleetdPolicy(
                    self.fleetd_config(),
                    pool,
                    reform_s=self.reform_s,
                    join_reform_s=self.join_reform_s,
                    startup_s=self.changeover_s,
                    leaving_signal=self.leaving_signal,
                    salvage_loss_s=self.salvage_loss_s,
                    tick_s=d.DEADLINE_PASS_INTERVAL_S.value,
                    # Can't Be Late's model, as the baselines have it (options.py sets it up).
                    progress_survives_loss=job.checkpoint_stall_s == 0 and job.no_notice_share == 0,
                )
            return FleetdPolicy(
                self.fleetd_config(),
                pool,
                reform_s=self.reform_s,
                join_reform_s=self.join_reform_s,
                leaving_signal=self.leaving_signal,
                salvage_loss_s=self.salvage_loss_s,
            )
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(self.all_names())}")

    def baseline_interval_s(self, removals_only: bool) -> float:
        """Checkpoint-restart rolls back on every loss, torchrun on every change."""
        if self.periodic_checkpoint_s is not None:
            return self.periodic_checkpoint_s
        times = {ev.t for ev in self.trace.events if ev.t > 0 and (ev.kind == "remove" or not removals_only)}
        if not times:
            return self.job.periodic_checkpoint_s
        mtbf = self.trace.duration_s / len(times)
        return max(self.job.checkpoint_stall_s, young_daly_interval_s(self.job.checkpoint_stall_s, mtbf))

    @staticmethod
    def all_names() -> tuple[str, ...]:
        return tuple(dict.fromkeys(CLUSTER_POLICIES + DEADLINE_POLICIES))

    def horizon_s(self, trace: Trace | None = None) -> float:
        tr = trace or self.trace
        if self.job.deadline_s is not None:
            # Deadline jobs may run past the trace on on-demand; stop at 3x the deadline.
            return max(tr.duration_s, 3 * self.job.deadline_s)
        return tr.duration_s

    def capacity_retry_s(self) -> float:
        """Every policy's retry after a short spot attempt: fleetd's own capacity-error TTL (the
        config default, `defaults.CAPACITY_RETRY_S`, unless --config sets another)."""
        return self.fleetd_config().capacity.capacity_error_ttl_s

    def run(self, name: str, sample_every_s: float = 0.0, trace: Trace | None = None) -> SimResult:
        tr = trace or self.trace
        return simulate(
            tr,
            self.make_policy(name),
            self.job,
            self.spot_price,
            self.on_demand_price,
            seed=self.seed,
            horizon_s=self.horizon_s(tr),
            sample_every_s=sample_every_s,
            capacity_retry_s=self.capacity_retry_s(),
            capacity_signal=self.capacity_signal,
        )


def ideal_steps(trace: Trace, job: JobSpec) -> float:
    """Steps a perfect elastic job (no overheads) would do using every live node up to max."""
    total = 0.0
    events = trace.events
    live = 0
    for i, ev in enumerate(events):
        live += 1 if ev.kind == "add" else -1
        end = events[i + 1].t if i + 1 < len(events) else trace.duration_s
        total += job.throughput(min(live, job.max_nodes)) * max(0.0, end - ev.t)
    return total
