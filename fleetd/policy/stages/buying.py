"""Steps 5 and 6: where to buy (ranked spot pools, on-demand fallback) and how many the budget allows."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import replace

from fleetd.config import FleetdConfig
from fleetd.policy import budget as budget_policy
from fleetd.policy.model import BudgetLevel, Launch, LaunchPurpose, Market, NodePhase, PoolId
from fleetd.policy.observation import PoolStats
from fleetd.policy.placement import RankedPool, diversify, rank_pools, reclaim_wave_left_s
from fleetd.policy.stages.pass_state import LEVEL_ORDER, PlanPass


def _interrupting_pools(p: PlanPass) -> frozenset[PoolId]:
    return frozenset(n.pool for n in p.obs.nodes if n.notice_at is not None)


def spot_pools(p: PlanPass, stats: Mapping[PoolId, PoolStats] | None = None) -> tuple[list[RankedPool], list[str]]:
    """Spot pools ranked for this pass; ``stats`` replaces the observed pool history (the probe
    ranks with aged capacity errors forgotten)."""
    return rank_pools(
        p.obs.offers,
        p.obs.stats_by_pool() if stats is None else stats,
        p.cfg.capacity,
        p.now,
        Market.SPOT,
        avoid=_interrupting_pools(p),
        reform_cost_h=reform_cost_h(p),
        fleet_zone=fleet_zone(p),
    )


def reform_cost_h(p: PlanPass) -> float:
    """Node-hours the fleet loses to the re-forms of one interruption: the leave and the
    replacement's join each stall every training rank for a checkpoint and a rendezvous round."""
    reb = p.cfg.rebalance
    training = sum(1 for n in p.kept if n.phase is NodePhase.RUNNING)
    return 2 * max(1, training) * (reb.checkpoint_stall_s + reb.reform_s) / 3600.0


def fleet_zone(p: PlanPass) -> str | None:
    """The zone most of the job's nodes are in (None: no node yet)."""
    zones = Counter(n.pool.zone for n in p.kept)
    if not zones:
        return None
    return min(zones, key=lambda z: (-zones[z], z))


def buy(
    p: PlanPass,
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
    asked = p.deadline is not None and p.deadline.on_demand_now
    if cap.on_demand == "never":
        p.notes.append('no on-demand (capacity.on_demand = "never"): waiting for spot')
    elif LEVEL_ORDER.index(level) >= LEVEL_ORDER.index(BudgetLevel.FORBID_ON_DEMAND):
        p.notes.append(f"on-demand fallback forbidden at budget level {level.value}: waiting for spot")
    elif asked and (wave := _reclaim_wave_ends_in(p)) is not None and _can_wait_for_wave(p, wave, need):
        p.notes.append(
            f"{p.deadline.reason}; but a spot pool's reclaim wave ends in {wave:.0f} s and the "  # type: ignore[union-attr]
            "deadline has slack for that and a changeover: waiting for spot rather than paying on-demand"
        )
    elif not asked and cap.on_demand == "deadline":
        p.notes.append(
            "no on-demand: "
            + (p.deadline.reason if p.deadline is not None else "no job.deadline asks for it")
            + ' (capacity.on_demand = "deadline"): waiting for spot'
        )
    elif not asked and (since is None or p.now - since < cap.spot_wait_s):
        waited = 0.0 if since is None else p.now - since
        p.notes.append(
            f"waiting for spot {waited:.0f} of spot_wait_s {cap.spot_wait_s:.0f} s before falling back to on-demand"
        )
    elif (p.deadline is None or p.deadline.spot_allowed) and (probe := _spot_probe(p, need, headroom)):
        headroom = headroom.after(probe)
    else:
        od_ranked, od_skipped = rank_pools(
            p.obs.offers,
            p.obs.stats_by_pool(),
            cap,
            p.now,
            Market.ON_DEMAND,
            reform_cost_h=reform_cost_h(p),
            fleet_zone=fleet_zone(p),
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
                prefix=(
                    f"{p.deadline.reason}: "
                    if asked and p.deadline is not None
                    else f"no spot for {p.now - (since or p.now):.0f} s >= spot_wait_s {cap.spot_wait_s:.0f}: "
                ),
            )
            if launch:
                headroom = headroom.after(launch)
    return headroom, True


def spot_probe_pools(p: PlanPass) -> list[RankedPool]:
    """Spot pools skipped only for a capacity error at least ``capacity.spot_probe_s`` old (capped
    at the TTL), ranked as if the error were forgotten. EC2 says nothing when capacity returns: a
    pass about to pay on-demand tries these first (a failed try costs one CreateFleet call and
    one pass; a baseline that tries spot at every decision would otherwise win the time back)."""
    cap = p.cfg.capacity
    probe_after = min(cap.spot_probe_s, cap.capacity_error_ttl_s)
    stats = p.obs.stats_by_pool()
    aged = {
        pool: replace(s, capacity_error_until=None)
        for pool, s in stats.items()
        if s.capacity_error_until is not None
        and s.capacity_error_until > p.now
        and p.now - (s.capacity_error_until - cap.capacity_error_ttl_s) >= probe_after
    }
    if not aged:
        return []
    ranked, _ = spot_pools(p, {**stats, **aged})
    return [r for r in ranked if r.pool in aged]


def _spot_probe(p: PlanPass, need: int, headroom: budget_policy.Headroom) -> Launch | None:
    ranked = spot_probe_pools(p)
    if not ranked:
        return None
    cap = p.cfg.capacity
    return _gated_launch(
        p,
        need,
        LaunchPurpose.CAPACITY,
        Market.SPOT,
        diversify(ranked, cap),
        headroom,
        ranked,
        prefix=(
            f"probe before paying on-demand: spot capacity error >= spot_probe_s "
            f"{min(cap.spot_probe_s, cap.capacity_error_ttl_s):.0f} s old, trying spot again: "
        ),
    )


def wave_pools_to_buy_now(p: PlanPass, need: int) -> list[RankedPool]:
    """Spot pools held back only by a reclaim wave, ranked with the wave forgotten, when a
    deadline job outside its safety net could not wait the wave out without the wait itself
    carrying it into the net (`DeadlineCall.can_wait_s`): the net finishes the job on on-demand,
    while a node bought in the wave's pool and reclaimed with it costs one changeover and the
    net still covers it (the purchase is made with the net's 2d of slack, as any spot purchase
    outside it). [] otherwise: the wave is waited out, as for a job with no deadline."""
    dl = p.deadline
    wave = _reclaim_wave_ends_in(p)
    if need <= 0 or dl is None or not dl.spot_allowed or wave is None or _can_wait_for_wave(p, wave, need):
        return []
    stats = p.obs.stats_by_pool()
    calm = {pool: replace(s, last_notice_at=None) for pool, s in stats.items() if reclaim_wave_left_s(s, p.now) > 0}
    ranked, _ = spot_pools(p, {**stats, **calm})
    why = (
        f"reclaim wave under way, but waiting {wave:.0f} s for it would carry the deadline job into "
        f"its safety net (slack {dl.slack_s or 0:.0f} s, net below 2 x changeover {2 * dl.changeover_s:.0f} s), "
        "which finishes on on-demand: buying spot in it now"
    )
    return [replace(r, reason=f"{why}: {r.reason}") for r in ranked if r.pool in calm]


def _can_wait_for_wave(p: PlanPass, wave_s: float, need: int) -> bool:
    """The deadline's call on waiting ``wave_s`` with ``need`` of the target missing, the next
    pass up to one reconcile interval after the wave's end."""
    assert p.deadline is not None
    return p.deadline.can_wait_s(wave_s, need / max(1, p.target), p.cfg.fleet.reconcile_interval_s)


def _reclaim_wave_ends_in(p: PlanPass) -> float | None:
    """Seconds until the first spot pool held back only by a reclaim wave under way is usable
    again (placement.reclaim_wave_left_s); None if no pool is."""
    stats = p.obs.stats_by_pool()
    ends = []
    for offer in p.obs.offers:
        s = stats.get(offer.pool)
        if offer.spot_price is None or s is None:
            continue
        if s.capacity_error_until is not None and s.capacity_error_until > p.now:
            continue
        if (left := reclaim_wave_left_s(s, p.now)) > 0:
            ends.append(left)
    return min(ends) if ends else None


def _gated_launch(
    p: PlanPass,
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
    cut = f" (wanted {need}; budget allows {count}: {headroom.explain()})" if count < need else ""
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
