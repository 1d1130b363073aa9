"""Scaling: the target node count, from GPU utilisation and measured throughput per world size.

Rules, first match wins: (1) the target lies in [min_nodes, max_nodes]; (2) budget SHRINK: one
fewer per pass; (3) cool-down; (4) only a fleet at its target and reporting is judged; (5) mean
utilisation below scale_down_util_pct, or (6) the last node adds less than min_marginal_efficiency
x (1 - hysteresis) of the average steps/s per dollar: one fewer; (7) busy, budget NORMAL and below
warn_at with one more, and that node worth min_marginal_efficiency: one more. Otherwise hold.
Without NVML the throughput decides alone (docs/DESIGN.md "Scaling").
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from fleetd.config import FleetdConfig
from fleetd.policy.model import BudgetLevel, Node, NodePhase


@dataclass(frozen=True, slots=True)
class TargetDecision:
    target: int
    reason: str

    def changed_from(self, previous: int | None) -> bool:
        return previous is not None and previous != self.target


def initial_target(cfg: FleetdConfig) -> int:
    wanted = cfg.scaling.initial_nodes
    if wanted is None:
        wanted = cfg.fleet.max_nodes
    return min(max(wanted, cfg.fleet.min_nodes), cfg.fleet.max_nodes)


def marginal_efficiency(gain: float, next_price: float, throughput: float, cost: float) -> float:
    """Marginal throughput per dollar of one node, as a share of the average per dollar."""
    if throughput <= 0 or cost <= 0 or next_price <= 0:
        return 0.0
    return (gain / next_price) / (throughput / cost)


def decide_target(
    *,
    previous: int | None,
    training: list[Node],
    throughput_by_nodes: Mapping[int, float],
    budget_level: BudgetLevel,
    any_leaving: bool,
    next_node_price: float | None,
    last_scaling_at: float | None,
    cfg: FleetdConfig,
    now: float,
    up_blocked_by_budget: str = "",
) -> TargetDecision:
    """``training``: kept nodes in phase RUNNING (the ones whose telemetry means something).
    ``up_blocked_by_budget``: why one more node would push the budget to warn ("" if it would not).

    In order: what needs no measurement (the first target, bounds, the budget's shrink, the
    cool-down); whether the fleet can be judged at all; scaling down; scaling up."""
    if previous is None:
        start = initial_target(cfg)
        return TargetDecision(start, f"starting with {start} nodes (initial target)")
    early = _without_measuring(previous, budget_level, any_leaving, last_scaling_at, cfg, now)
    if early is not None:
        return early
    n = len(training)
    utils = [x.gpu_util_pct for x in training if x.gpu_util_pct is not None]
    here = throughput_by_nodes.get(n)
    # GPU utilisation where NVML reports it; without it (CPU nodes, no driver) the measured
    # throughput alone decides, which needs a measurement at the current size.
    if n != previous or (not utils and here is None):
        return TargetDecision(
            previous,
            f"holding at {previous}: {n} nodes training with {len(utils)} reporting GPU "
            f"utilisation and throughput at {n} nodes {'measured' if here is not None else 'not measured yet'}; "
            "judging scale only once the fleet is at its target and reporting",
        )
    fleet = _Measured(
        n=n,
        util=statistics.fmean(utils) if utils else None,
        here=here,
        below=throughput_by_nodes.get(n - 1),
        above=throughput_by_nodes.get(n + 1),
        cost=sum(x.price_per_hour for x in training),
    )
    down = _scale_down(previous, fleet, cfg)
    if down is not None:
        return down
    return _scale_up(previous, fleet, budget_level, up_blocked_by_budget, next_node_price, cfg)


def _without_measuring(
    previous: int,
    budget_level: BudgetLevel,
    any_leaving: bool,
    last_scaling_at: float | None,
    cfg: FleetdConfig,
    now: float,
) -> TargetDecision | None:
    """Decisions that need no telemetry: a target out of bounds, the budget's shrink, the cool-down."""
    lo, hi = cfg.fleet.min_nodes, cfg.fleet.max_nodes
    if not lo <= previous <= hi:
        bounded = min(max(previous, lo), hi)
        return TargetDecision(bounded, f"target {previous} is outside [min_nodes={lo}, max_nodes={hi}]: now {bounded}")
    if budget_level is BudgetLevel.SHRINK:
        if previous <= lo:
            return TargetDecision(previous, f"budget says shrink, but already at min_nodes={lo}")
        if any_leaving:
            return TargetDecision(previous, "budget says shrink: waiting for the node already leaving first")
        return TargetDecision(
            previous - 1,
            f"budget forecast past shrink_at: shrinking from {previous} to {previous - 1} "
            f"nodes (toward min_nodes={lo})",
        )
    sc = cfg.scaling
    if last_scaling_at is not None and now - last_scaling_at < sc.cooldown_s:
        return TargetDecision(
            previous,
            f"holding at {previous}: cool-down, last change {now - last_scaling_at:.0f} s ago "
            f"(cooldown_s={sc.cooldown_s:.0f})",
        )
    return None


@dataclass(frozen=True, slots=True)
class _Measured:
    """The fleet at its target, as its telemetry shows it."""

    n: int
    util: float | None  # mean GPU utilisation (None: no NVML)
    here: float | None  # steps/s measured at n nodes
    below: float | None  # ... at n - 1
    above: float | None  # ... at n + 1
    cost: float  # USD per hour of the n nodes

    @property
    def avg_price(self) -> float:
        return self.cost / self.n


def _scale_down(previous: int, f: _Measured, cfg: FleetdConfig) -> TargetDecision | None:
    sc, lo = cfg.scaling, cfg.fleet.min_nodes
    if f.util is not None and f.util < sc.scale_down_util_pct and previous > lo:
        return TargetDecision(
            previous - 1,
            f"scale down {previous}->{previous - 1}: mean GPU utilisation {f.util:.0f}% < "
            f"scale_down_util_pct {sc.scale_down_util_pct:.0f}% (idle)",
        )
    if f.here is not None and f.below is not None and previous > lo:
        eff = marginal_efficiency(f.here - f.below, f.avg_price, f.here, f.cost)
        floor = sc.min_marginal_efficiency * (1 - sc.efficiency_hysteresis)
        if eff < floor:
            return TargetDecision(
                previous - 1,
                f"scale down {previous}->{previous - 1}: node {f.n} adds {f.here - f.below:.3f} "
                f"steps/s = {eff:.0%} of the average throughput per dollar, below "
                f"{floor:.0%} (min_marginal_efficiency {sc.min_marginal_efficiency:.0%} less "
                f"{sc.efficiency_hysteresis:.0%} hysteresis)",
            )
    return None


def _scale_up(
    previous: int,
    f: _Measured,
    budget_level: BudgetLevel,
    up_blocked_by_budget: str,
    next_node_price: float | None,
    cfg: FleetdConfig,
) -> TargetDecision:
    sc, hi, n, util, here = cfg.scaling, cfg.fleet.max_nodes, f.n, f.util, f.here
    if util is not None and util < sc.scale_up_util_pct:
        return TargetDecision(
            previous,
            f"holding at {previous}: mean GPU utilisation {util:.0f}% is between "
            f"scale_down_util_pct {sc.scale_down_util_pct:.0f}% and scale_up_util_pct "
            f"{sc.scale_up_util_pct:.0f}%",
        )
    busy = f"GPUs busy ({util:.0f}%)" if util is not None else "no GPU telemetry, throughput decides"
    if previous >= hi:
        return TargetDecision(previous, f"holding at max_nodes={hi}: {busy}")
    if budget_level is not BudgetLevel.NORMAL:
        return TargetDecision(
            previous, f"holding at {previous}: no scale-up while the budget is at {budget_level.value}"
        )
    if up_blocked_by_budget:
        return TargetDecision(previous, f"holding at {previous}: {up_blocked_by_budget}")
    if here is None:
        return TargetDecision(previous, f"holding at {previous}: no throughput measured at {n} nodes yet")
    price = next_node_price if next_node_price is not None else f.avg_price
    if f.above is not None:
        gain, source = f.above - here, f"measured at {n + 1} nodes"
    elif f.below is not None:
        gain, source = here - f.below, f"assumed equal to node {n}'s measured gain"
    else:
        why = (
            f"GPUs busy ({util:.0f}% >= {sc.scale_up_util_pct:.0f}%)"
            if util is not None
            else f"{here:.3f} steps/s measured at {n} nodes, no GPU telemetry"
        )
        return TargetDecision(
            previous + 1,
            f"scale up {previous}->{previous + 1}: {why} and no measurement beyond {n} nodes yet: exploring",
        )
    eff = marginal_efficiency(gain, price, here, f.cost)
    if eff >= sc.min_marginal_efficiency:
        return TargetDecision(
            previous + 1,
            f"scale up {previous}->{previous + 1}: {busy} and node {n + 1} "
            f"adds {gain:.3f} steps/s ({source}) = {eff:.0%} of the average throughput per "
            f"dollar >= min_marginal_efficiency {sc.min_marginal_efficiency:.0%}",
        )
    return TargetDecision(
        previous,
        f"holding at {previous}: node {n + 1} would add {gain:.3f} steps/s ({source}) = "
        f"{eff:.0%} of the average throughput per dollar < min_marginal_efficiency "
        f"{sc.min_marginal_efficiency:.0%}",
    )


INPUT_BOUND_CPU_PCT = 90.0  # a host CPU this busy while the GPUs wait: the input pipeline limits


def node_flag(node: Node, cfg: FleetdConfig) -> str | None:
    """Why a training node is not pulling its weight, for `fleetd status`; None when it is (or
    when nothing measured says otherwise). From the smoothed GPU utilisation (NVML) and the
    host CPU, so only nodes that report GPUs can be called idle or input-bound."""
    util, cpu = node.gpu_util_pct, node.cpu_pct
    if node.phase is not NodePhase.RUNNING or util is None:
        return None
    sc = cfg.scaling
    if util < sc.scale_down_util_pct:
        if cpu is not None and cpu >= INPUT_BOUND_CPU_PCT:
            return (
                f"input-bound: GPU {util:.0f}% while the host CPU is at {cpu:.0f}% "
                "(data loading or preprocessing keeps the GPUs waiting)"
            )
        return f"gpu-idle: GPU {util:.0f}% < scale_down_util_pct {sc.scale_down_util_pct:.0f}%"
    if util < sc.scale_up_util_pct and cpu is not None and cpu >= INPUT_BOUND_CPU_PCT:
        return (
            f"input-bound: GPU {util:.0f}% (< scale_up_util_pct {sc.scale_up_util_pct:.0f}%) while "
            f"the host CPU is at {cpu:.0f}%"
        )
    return None


def stragglers(
    training: list[Node], ratio: float, *, now: float | None = None, settle_s: float = 0.0
) -> list[tuple[Node, str]]:
    """Nodes much slower than the median (steps/s below ratio x median), slowest first.

    Only once the fleet has settled: for ``settle_s`` after any node joined, the rates nodes
    report still include the re-form pause (workers restarting, first steps), so a node that
    merely restarted last would look slow and be replaced for nothing.
    """
    if now is not None and any(now - x.launched_at < settle_s for x in training):
        return []
    rate = {x.instance_id: _judged_rate(x) for x in training}
    rates = [r for r in rate.values() if r is not None]
    if len(rates) < 2:
        return []
    median = statistics.median(rates)
    if median <= 0:
        return []
    slow = [
        x
        for x in training
        if x.phase is NodePhase.RUNNING and (r := rate[x.instance_id]) is not None and r < ratio * median
    ]
    slow.sort(key=lambda x: (rate[x.instance_id], x.instance_id))
    return [
        (
            x,
            f"{x.instance_id} is straggling: {rate[x.instance_id]:.3f} steps/s (averaged over its reports) "
            f"< straggler_ratio {ratio:.0%} of the median {median:.3f}; replacing it",
        )
        for x in slow
    ]


def _judged_rate(x: Node) -> float | None:
    """A node's rate as its reports average it: one slow report (a GC pause, a data-loader
    hiccup) is not a straggler, and replacing a node costs a re-form for the whole fleet."""
    return x.steps_per_s_avg if x.steps_per_s_avg is not None else x.steps_per_s
