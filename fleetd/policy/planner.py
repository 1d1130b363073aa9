"""The planner: one pure function from what is observed to what to do, each action with a reason.

    plan(obs: Observation, cfg: FleetdConfig, now: float) -> Plan

The daemon's reconcile loop and the simulator both call it; it reads no clock and does no I/O.
One pass, in order:
1. lifecycle: which nodes are lost (two-signal rule), broken boots, overdue drains -> Terminate;
2. budget: graded level from the forecast; at the cap (or when asked to stop) -> StopJob;
3. notices -> Drain; rebalance recommendations -> pre-buy / checkpoint (never a drain); a periodic
   checkpoint at the Young/Daly interval for the fleet's losses without notice;
4. scaling target (bounded by the budget level), stragglers, excess nodes -> Drain/Terminate;
5. placement for launches: ranked, diversified spot pools first; on-demand fallback after
   capacity.spot_wait_s if allowed and affordable; back to spot make-before-break after the next
   durable checkpoint;
6. budget gate: every launch is cut to what fits under both caps (budget.py), with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetd.config import FleetdConfig
from fleetd.policy import budget as budget_policy
from fleetd.policy import checkpointing
from fleetd.policy import rebalance as rebalance_policy
from fleetd.policy.lifecycle import TERMINAL_EC2_STATES, split_lost
from fleetd.policy.model import (
    Action,
    BudgetLevel,
    Drain,
    Launch,
    LaunchPurpose,
    Market,
    Node,
    NodePhase,
    Plan,
    PoolId,
    RequestCheckpoint,
    StopJob,
    Terminate,
    Warn,
)
from fleetd.policy.observation import DesiredJob, Observation, PoolStats
from fleetd.policy.placement import RankedPool, diversify, rank_pools
from fleetd.policy.scaling import decide_target, stragglers

__all__ = ["plan", "Observation", "PoolStats", "DesiredJob", "Plan"]

_LEVEL_ORDER = list(BudgetLevel)


@dataclass
class _Pass:
    """Mutable scratch for one pass; only plan() sees it."""

    obs: Observation
    cfg: FleetdConfig
    now: float
    actions: list[Action] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    billed: list[Node] = field(default_factory=list)  # still costing money after this plan
    kept: list[Node] = field(default_factory=list)  # counted as capacity (not leaving)
    checkpoint_requested: bool = False

    def remove(self, node: Node, reason: str) -> None:
        """Take a kept node out of the fleet: drain it if it trains, else terminate it."""
        self.kept.remove(node)
        if node.phase is NodePhase.RUNNING:
            deadline = self.now + self.cfg.rebalance.drain_timeout_s
            self.actions.append(Drain(reason=reason, instance_id=node.instance_id, deadline=deadline))
        else:
            self.billed.remove(node)
            self.actions.append(Terminate(reason=reason, instance_id=node.instance_id))

    def terminate(self, node: Node, reason: str) -> None:
        if node in self.kept:
            self.kept.remove(node)
        if node in self.billed:
            self.billed.remove(node)
        self.actions.append(Terminate(reason=reason, instance_id=node.instance_id))

    def request_checkpoint(self, action: RequestCheckpoint | None, note: str) -> None:
        if action is not None and not self.checkpoint_requested:
            self.actions.append(action)
            self.checkpoint_requested = True
        elif note:
            self.notes.append(note)


def plan(obs: Observation, cfg: FleetdConfig, now: float) -> Plan:
    p = _Pass(obs, cfg, now)
    _lifecycle(p)
    if obs.stop_issued_at is not None:
        return _finish_stop(p)

    view = budget_policy.assess(obs.spent_usd, p.billed, p.kept, cfg)
    if view.level is BudgetLevel.STOP or obs.desired_job is DesiredJob.STOP:
        why = view.reason if view.level is BudgetLevel.STOP else "job stop requested"
        p.actions.append(StopJob(reason=f"{why}: coordinated checkpoint, then stop every node"))
        return _result(p, view, target=0)
    if _LEVEL_ORDER.index(view.level) > _LEVEL_ORDER.index(obs.budget_level):
        p.actions.append(Warn(reason=view.reason, code=f"budget-{view.level.value}"))

    for drain in rebalance_policy.notice_drains(p.kept, now):
        p.actions.append(drain)
        p.kept = [n for n in p.kept if n.instance_id != drain.instance_id]

    target = _scale(p, view.level)
    spot_ranked, spot_skipped = _spot_pools(p)
    risk = _rebalance_risk(p, target, view.level)
    _periodic_checkpoint(p)
    sizing = _size_fleet(p, target, risk, bool(spot_ranked), view.level)

    headroom = budget_policy.headroom(obs.spent_usd, p.billed, p.kept, cfg)
    spot_short = False
    need = max(0, target - sizing.counted)
    if need:
        headroom, spot_short = _buy(
            p, need, LaunchPurpose.CAPACITY, spot_ranked, spot_skipped, headroom, view.level
        )
    if risk.prebuy:
        pools = [r for r in spot_ranked if r.pool not in risk.avoid]
        if pools:
            headroom, _ = _buy(p, risk.prebuy, LaunchPurpose.REBALANCE_PREBUY, pools, [], headroom, view.level)
        else:
            p.notes.append("no spot pool outside the at-risk pools to pre-buy in")
    if sizing.buy_spot_for_on_demand:
        headroom, _ = _buy(
            p, sizing.buy_spot_for_on_demand, LaunchPurpose.RETURN_TO_SPOT, spot_ranked, [], headroom, view.level
        )
    return _result(p, view, target=target, spot_short=spot_short)


def _rebalance_risk(p: _Pass, target: int, level: BudgetLevel) -> rebalance_policy.RiskPlan:
    """Pre-buys for nodes with a rebalance recommendation, and a checkpoint if the last is old."""
    obs, cfg = p.obs, p.cfg
    risk = rebalance_policy.plan_risk(
        p.kept,
        target,
        obs.rebalance_prebuys_last_hour,
        level in (BudgetLevel.NORMAL, BudgetLevel.WARN),
        cfg,
    )
    p.notes.extend(risk.notes)
    if risk.at_risk:
        p.request_checkpoint(
            *rebalance_policy.checkpoint_if_stale(
                why="rebalance recommendation",
                last_durable_at=obs.last_durable_checkpoint_at,
                last_request_at=obs.last_checkpoint_request_at,
                max_age_s=cfg.rebalance.max_checkpoint_age_s,
                retry_s=cfg.rebalance.checkpoint_retry_s,
                now=p.now,
            )
        )
    return risk


def _periodic_checkpoint(p: _Pass) -> None:
    """Bound the work a loss without notice rolls back (checkpointing.py: Young/Daly)."""
    if not p.cfg.rebalance.young_daly_checkpoints:
        return
    training = sum(1 for n in p.kept if n.phase is NodePhase.RUNNING)
    cadence = checkpointing.cadence(p.obs.pool_stats, training, p.cfg.rebalance.checkpoint_stall_s)
    p.request_checkpoint(
        *checkpointing.periodic_checkpoint(
            cadence,
            last_durable_at=p.obs.last_durable_checkpoint_at,
            last_request_at=p.obs.last_checkpoint_request_at,
            retry_s=p.cfg.rebalance.checkpoint_retry_s,
            now=p.now,
        )
    )


@dataclass(frozen=True, slots=True)
class _Sizing:
    counted: int  # kept nodes that count toward the target
    # Spot nodes to launch now to replace on-demand ones (back to spot, make-before-break).
    buy_spot_for_on_demand: int


def _size_fleet(
    p: _Pass, target: int, risk: rebalance_policy.RiskPlan, spot_available: bool, level: BudgetLevel
) -> _Sizing:
    """Remove what is beyond the target, shed burn above the cap, and move off on-demand.

    Nodes beyond the target are not excess when they cover an at-risk node (a pre-buy), or when
    they are spot nodes bought to replace on-demand nodes (back to spot). Back to spot moves
    every on-demand node at once: one launch for all of them, then one drain of all of them in
    one pass, so the fleet re-forms twice in all rather than twice per on-demand node (each
    re-form stalls every rank for a checkpoint and a rendezvous round).
    """
    extras = max(0, len(p.kept) - target - risk.covered)
    on_demand = [n for n in p.kept if n.market is Market.ON_DEMAND]
    back_to_spot = bool(on_demand) and spot_available and level is not BudgetLevel.SHRINK
    replacements = min(len(on_demand), extras) if back_to_spot else 0
    counted = len(p.kept) - risk.covered - replacements
    if counted > target:
        _remove_excess(p, counted - target, target, risk.at_risk)
    _shed_burn(p)
    on_demand = [n for n in p.kept if n.market is Market.ON_DEMAND]  # after removals
    if replacements and on_demand:
        replacements -= _return_to_spot(p, on_demand, min(replacements, len(on_demand)))
    still_on_demand = sum(1 for n in p.kept if n.market is Market.ON_DEMAND)
    replacements = min(replacements, still_on_demand)  # a replacement with nothing to replace counts
    return _Sizing(
        counted=len(p.kept) - risk.covered - replacements,
        buy_spot_for_on_demand=max(0, still_on_demand - replacements) if back_to_spot else 0,
    )


# ------------------------------------------------------------------------------------ lifecycle
def _lifecycle(p: _Pass) -> None:
    cfg, now = p.cfg, p.now
    lost, alive = split_lost(p.obs.nodes, now, cfg.rebalance.silence_s)
    for verdict in lost:
        node = verdict.node
        if node.ec2_state in TERMINAL_EC2_STATES or node.phase is NodePhase.TERMINATED:
            p.notes.append(verdict.reason)
        else:
            p.actions.append(
                Terminate(reason=f"{verdict.reason}; terminating so it stops billing", instance_id=node.instance_id)
            )
    p.billed = list(alive)
    p.kept = [n for n in alive if not n.leaving]
    # A silent new node is a broken boot only while other nodes do report: when nobody reports,
    # the broker or the intake is down, and replacing every node would not help.
    others_report = any(n.last_seen_at is not None for n in alive)
    for node in list(p.billed):
        if node.phase is NodePhase.PENDING and node.last_seen_at is None:
            age = now - node.launched_at
            if age > cfg.capacity.boot_timeout_s and others_report:
                p.terminate(
                    node,
                    f"{node.instance_id} never reported in {age:.0f} s (boot_timeout_s "
                    f"{cfg.capacity.boot_timeout_s:.0f}) while other nodes do: broken boot",
                )
        elif node.phase is NodePhase.LEAVING:
            p.terminate(node, f"{node.instance_id} has left the rendezvous: terminating it")
        elif node.phase is NodePhase.DRAINING and node.has_left:
            # Its checkpoint is durable and it is out of the rendezvous: every second it stays
            # up until AWS reclaims it (or the drain times out) is paid for nothing.
            p.terminate(
                node,
                f"{node.instance_id} has left the rendezvous (trainer exited "
                f"{now - node.left_at:.0f} s ago, after its drain): terminating it so it stops billing",
            )
        elif node.phase is NodePhase.DRAINING:
            overdue = _drain_overdue(node, now, cfg.rebalance.drain_timeout_s)
            if overdue:
                p.terminate(node, f"{node.instance_id} drain overdue ({overdue}): terminating it")


def _drain_overdue(node: Node, now: float, timeout_s: float) -> str:
    if node.notice_deadline is not None and now > node.notice_deadline:
        return f"notice deadline passed {now - node.notice_deadline:.0f} s ago"
    if node.drain_started_at is not None and now - node.drain_started_at > timeout_s:
        return f"draining for {now - node.drain_started_at:.0f} s > drain_timeout_s {timeout_s:.0f}"
    return ""


def _finish_stop(p: _Pass) -> Plan:
    elapsed = p.now - (p.obs.stop_issued_at or p.now)
    reserve = p.cfg.budget.stop_reserve_s
    if elapsed >= reserve:
        for node in list(p.billed):
            p.terminate(
                node,
                f"stop issued {elapsed:.0f} s ago (stop_reserve_s {reserve:.0f}): terminating "
                f"{node.instance_id} so spend stays inside the budget",
            )
    elif p.billed:
        p.notes.append(
            f"stopping: {len(p.billed)} nodes finishing checkpoint and shutdown "
            f"({elapsed:.0f} of {reserve:.0f} s)"
        )
    view = budget_policy.assess(p.obs.spent_usd, p.billed, [], p.cfg)
    return _result(p, view, target=0)


# -------------------------------------------------------------------------------------- scaling
def _scale(p: _Pass, level: BudgetLevel) -> int:
    obs, cfg = p.obs, p.cfg
    training = [n for n in p.kept if n.phase is NodePhase.RUNNING]
    any_leaving = any(n.leaving for n in p.billed) or any(isinstance(a, Drain) for a in p.actions)
    cheapest = None
    ranked, _ = _spot_pools(p)
    if ranked:
        cheapest = ranked[0].price_per_hour
    decision = decide_target(
        up_blocked_by_budget=_scale_up_would_warn(p, cheapest),
        previous=obs.target_nodes,
        training=training,
        throughput_by_nodes=obs.throughput_by_nodes,
        budget_level=level,
        any_leaving=any_leaving,
        next_node_price=cheapest,
        last_scaling_at=obs.last_scaling_at,
        cfg=cfg,
        now=p.now,
    )
    p.notes.append(decision.reason)
    if (
        level is BudgetLevel.NORMAL
        and not any_leaving
        and decision.target == obs.target_nodes
        and len(p.kept) >= decision.target
    ):
        slow = stragglers(training, cfg.scaling.straggler_ratio, now=p.now, settle_s=cfg.scaling.straggler_settle_s)
        if slow:
            node, reason = slow[0]
            # Replacing it needs room for one more node at its price (the drain frees it later).
            room = budget_policy.headroom(obs.spent_usd, p.billed, p.kept, cfg)
            if len(p.kept) > cfg.fleet.min_nodes or room.affordable(
                node.price_per_hour, node.worst_case_price_per_hour
            ):
                p.remove(node, reason)
            else:
                p.notes.append(f"{reason}: not now, no budget room for its replacement")
    return decision.target


def _scale_up_would_warn(p: _Pass, price: float | None) -> str:
    """Budget hysteresis: a scale-up must not by itself push the forecast to warn_at, or the
    fleet would grow and shrink in turns."""
    if price is None:
        return ""
    b = p.cfg.budget
    burn = budget_policy.burn_usd_per_hour(p.kept) + price
    share = (p.obs.spent_usd + burn * b.forecast_horizon_s / 3600.0) / b.total_usd
    if share >= b.warn_at:
        return (
            f"one more node (${price:.3f}/h) would bring the forecast to {share:.0%} >= "
            f"warn_at {b.warn_at:.0%}"
        )
    return ""


def _removal_order(nodes: list[Node], at_risk: tuple[Node, ...]) -> list[Node]:
    """Cheapest to lose first: not yet training, on-demand, at risk, most expensive, newest."""
    risky = {n.instance_id for n in at_risk}
    return sorted(
        nodes,
        key=lambda n: (
            n.phase is NodePhase.RUNNING,
            n.market is not Market.ON_DEMAND,
            n.instance_id not in risky,
            -n.price_per_hour,
            -n.launched_at,
            n.instance_id,
        ),
    )


def _remove_excess(p: _Pass, excess: int, target: int, at_risk: tuple[Node, ...]) -> None:
    for node in _removal_order(p.kept, at_risk)[:excess]:
        p.remove(node, f"scaling to {target} nodes: removing {node.instance_id} ({node.market.value} "
                       f"${node.price_per_hour:.3f}/h, {node.phase.value})")


def _shed_burn(p: _Pass) -> None:
    """Prices rose since the last pass: shed the priciest nodes until the burn fits again."""
    cap = p.cfg.budget.max_usd_per_hour
    while (
        budget_policy.burn_usd_per_hour(p.kept) > cap + 1e-9
        and len(p.kept) > p.cfg.fleet.min_nodes
    ):
        burn = budget_policy.burn_usd_per_hour(p.kept)
        node = max(p.kept, key=lambda n: (n.price_per_hour, n.instance_id))
        p.remove(
            node,
            f"burn ${burn:.2f}/h exceeds max_usd_per_hour ${cap:.2f}: removing "
            f"{node.instance_id} (${node.price_per_hour:.3f}/h)",
        )


# ------------------------------------------------------------------------------------ placement
def _interrupting_pools(p: _Pass) -> frozenset[PoolId]:
    return frozenset(n.pool for n in p.obs.nodes if n.notice_at is not None)


def _spot_pools(p: _Pass) -> tuple[list[RankedPool], list[str]]:
    return rank_pools(
        p.obs.offers,
        p.obs.stats_by_pool(),
        p.cfg.capacity,
        p.now,
        Market.SPOT,
        avoid=_interrupting_pools(p),
    )


def _buy(
    p: _Pass,
    need: int,
    purpose: LaunchPurpose,
    spot_ranked: list[RankedPool],
    spot_skipped: list[str],
    headroom: budget_policy.Headroom,
    level: BudgetLevel,
) -> tuple[budget_policy.Headroom, bool]:
    """Launch ``need`` nodes: spot if any pool is available, else maybe on-demand. Returns the
    headroom left and whether spot was short."""
    if spot_ranked:
        launch = _gated_launch(
            p, need, purpose, Market.SPOT, diversify(spot_ranked, p.cfg.capacity), headroom, spot_ranked
        )
        return (headroom.after(launch) if launch else headroom), False
    why_none = "; ".join(spot_skipped) or "no spot offers"
    p.notes.append(f"need {need} node(s) ({purpose.value}) but no spot pool is available: {why_none}")
    if purpose is not LaunchPurpose.CAPACITY:
        return headroom, True
    cap = p.cfg.capacity
    since = p.obs.spot_unavailable_since
    if not cap.allow_on_demand:
        p.notes.append("on-demand fallback disabled (capacity.allow_on_demand = false): waiting for spot")
    elif _LEVEL_ORDER.index(level) >= _LEVEL_ORDER.index(BudgetLevel.FORBID_ON_DEMAND):
        p.notes.append(f"on-demand fallback forbidden at budget level {level.value}: waiting for spot")
    elif since is None or p.now - since < cap.spot_wait_s:
        waited = 0.0 if since is None else p.now - since
        p.notes.append(
            f"waiting for spot {waited:.0f} of spot_wait_s {cap.spot_wait_s:.0f} s before "
            "falling back to on-demand"
        )
    elif churn := _fallback_churn(p, need):
        p.notes.append(churn)
    else:
        od_ranked, od_skipped = rank_pools(
            p.obs.offers, p.obs.stats_by_pool(), cap, p.now, Market.ON_DEMAND
        )
        if not od_ranked:
            p.notes.append("no on-demand pool available either: " + ("; ".join(od_skipped) or "no offers"))
        else:
            launch = _gated_launch(
                p,
                need,
                LaunchPurpose.ON_DEMAND_FALLBACK,
                Market.ON_DEMAND,
                diversify(od_ranked, cap),
                headroom,
                od_ranked,
                prefix=f"no spot for {p.now - since:.0f} s >= spot_wait_s {cap.spot_wait_s:.0f}: ",
            )
            if launch:
                headroom = headroom.after(launch)
    return headroom, True


def _fallback_churn(p: _Pass, need: int) -> str:
    """Why an on-demand fallback would cost more training than it adds ("" if it would not).

    A spot pool held back only by its own recent notice is offered again when its interrupting
    window ends; then back to spot drains the on-demand nodes. So they would train until then at
    most, and cost two membership changes (their join, their leave), each stalling every rank for
    a checkpoint and a re-form. Buy them only if they would train longer than they stall the fleet.
    """
    back_at = _spot_back_at(p)
    if back_at is None:
        return ""  # spot's return is unknown (capacity errors, no offers): fall back
    reb = p.cfg.rebalance
    change_s = reb.checkpoint_stall_s + reb.reform_s
    training = sum(1 for n in p.kept if n.phase is NodePhase.RUNNING)
    stall_node_s = 2 * (training + need) * change_s
    useful_node_s = need * max(0.0, back_at - p.now)
    if useful_node_s >= stall_node_s:
        return ""
    return (
        f"no on-demand fallback: spot is offered again in {back_at - p.now:.0f} s (interrupting "
        f"window), so {need} on-demand node(s) would train {useful_node_s:.0f} node-s, less than "
        f"their join and leave stall the fleet (2 x {training + need} nodes x {change_s:g} s = "
        f"{stall_node_s:.0f} node-s): waiting for spot"
    )


def _spot_back_at(p: _Pass) -> float | None:
    """When the first spot pool held back only by its interrupting window is offered again;
    None if some pool's return is not known (capacity error, no spot price)."""
    stats = p.obs.stats_by_pool()
    window = p.cfg.capacity.interrupting_window_s
    back: list[float] = []
    for offer in p.obs.offers:
        if offer.spot_price is None or offer.spot_price >= offer.on_demand_price:
            continue
        s = stats.get(offer.pool)
        if s is None or s.last_notice_at is None or p.now - s.last_notice_at > window:
            return None  # not held back by a notice: its shortage is of another kind
        if s.capacity_error_until is not None and s.capacity_error_until > s.last_notice_at + window:
            return None
        back.append(s.last_notice_at + window)
    return min(back) if back else None


def _gated_launch(
    p: _Pass,
    need: int,
    purpose: LaunchPurpose,
    market: Market,
    chosen: list[RankedPool],
    headroom: budget_policy.Headroom,
    ranked: list[RankedPool],
    prefix: str = "",
) -> Launch | None:
    """The budget gate: cut the launch to what fits. When the diversified set does not fit, narrow
    it by dropping its priciest pool, and last try the cheapest pool per node of all."""
    candidates = [list(chosen)]
    while len(candidates[-1]) > 1:
        shorter = list(candidates[-1])
        shorter.remove(max(shorter, key=lambda r: (r.price_per_hour, str(r.pool))))
        candidates.append(shorter)
    candidates.append([min(ranked, key=lambda r: (r.price_per_hour, r.offer.on_demand_price, str(r.pool)))])
    best: tuple[int, list[RankedPool]] = (0, chosen)
    for pools in candidates:
        price_now, bid = _prices(pools, market, p.cfg)
        count = min(need, headroom.affordable(price_now, bid if bid is not None else price_now))
        if count > best[0]:
            best = (count, pools)
        if count >= need:
            break
    count, pools = best
    if count == 0:
        p.notes.append(
            f"{prefix}cannot buy {need} {market.value} node(s) ({purpose.value}): "
            f"not even one fits the budget ({headroom.explain()})"
        )
        return None
    price_now, bid = _prices(pools, market, p.cfg)
    ranking = "; ".join(r.reason for r in pools)
    cut = (
        f" (wanted {need}; budget allows {count}: {headroom.explain()})" if count < need else ""
    )
    launch = Launch(
        reason=f"{prefix}{purpose.value}: buy {count} {market.value} node(s){cut}; pools by "
        f"expected cost per useful GPU-hour: {ranking}",
        count=count,
        market=market,
        pools=tuple(r.pool for r in pools),
        max_price_per_hour=bid,
        budgeted_price_per_hour=price_now,
        purpose=purpose,
        max_total_price_per_hour=round(max(headroom.usd_per_hour, 0.0), 6),
    )
    p.actions.append(launch)
    return launch


def _prices(pools: list[RankedPool], market: Market, cfg: FleetdConfig) -> tuple[float, float | None]:
    """(highest current price among pools, spot bid or None on on-demand)."""
    price_now = max(r.price_per_hour for r in pools)
    if market is Market.ON_DEMAND:
        return price_now, None
    bid = max(r.offer.on_demand_price for r in pools)
    if cfg.capacity.max_spot_price_per_hour is not None:
        bid = min(bid, cfg.capacity.max_spot_price_per_hour)
    return price_now, max(bid, price_now)


def _return_to_spot(p: _Pass, on_demand: list[Node], replacements: int) -> int:
    """Spot nodes beyond the target exist: once they all train and a checkpoint taken after the
    last of them joined is durable, drain as many on-demand nodes as there are spot nodes to
    take their place, priciest first, in this one pass (make-before-break, never mid-step).
    Returns how many were drained."""
    spot_running = [
        n for n in p.kept if n.market is Market.SPOT and n.phase is NodePhase.RUNNING
    ]
    spot_pending = [n for n in p.kept if n.market is Market.SPOT and n.phase is NodePhase.PENDING]
    if not spot_running or spot_pending:
        p.notes.append("back to spot: waiting for the new spot node to join training")
        return 0
    joined = max(n.running_since if n.running_since is not None else n.launched_at for n in spot_running)
    durable = p.obs.last_durable_checkpoint_at
    victims = sorted(on_demand, key=lambda n: (-n.price_per_hour, n.instance_id))[:replacements]
    if durable is not None and durable >= joined:
        for victim in victims:
            p.remove(
                victim,
                f"back to spot: spot capacity is training again and checkpoint step "
                f"{p.obs.last_durable_checkpoint_step} is durable ({p.now - durable:.0f} s ago): "
                f"draining on-demand {victim.instance_id} (${victim.price_per_hour:.3f}/h)"
                + (f", one of {len(victims)} leaving together" if len(victims) > 1 else ""),
            )
        return len(victims)
    names = ", ".join(v.instance_id for v in victims)
    waiting = f"back to spot: draining on-demand {names} after the next durable checkpoint"
    requested = p.obs.last_checkpoint_request_at
    if requested is not None and requested >= joined and p.now - requested < p.cfg.rebalance.checkpoint_retry_s:
        p.notes.append(f"{waiting}; checkpoint requested {p.now - requested:.0f} s ago")
        return 0
    p.request_checkpoint(
        RequestCheckpoint(reason=f"{waiting}: none is durable since the spot node joined"), ""
    )
    return 0


# ---------------------------------------------------------------------------------------- result
def _result(p: _Pass, view: budget_policy.BudgetView, target: int, spot_short: bool = False) -> Plan:
    launches = [a for a in p.actions if isinstance(a, Launch)]
    burn_after = budget_policy.burn_usd_per_hour(p.kept) + sum(
        a.count * a.budgeted_price_per_hour for a in launches
    )
    window = budget_policy.commit_window_s(p.cfg)
    committed = (
        p.obs.spent_usd
        + budget_policy.node_commitment_usd(p.billed, window)
        + sum(
            budget_policy.launch_commitment_usd(a.count, a.worst_case_price_per_hour, window)
            for a in launches
        )
    )
    if not p.actions:
        p.notes.append(f"no action: {view.reason}")
    return Plan(
        actions=tuple(p.actions),
        notes=tuple(p.notes),
        target_nodes=target,
        budget=view.status(burn_after, committed),
        spot_short=spot_short,
    )
