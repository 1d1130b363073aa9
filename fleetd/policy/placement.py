"""Placement: which pools to buy from, ranked by expected cost per useful GPU-hour.

score = price / (GPUs x relative throughput of the GPU model, A10G = 1)
        x (1 + expected interruptions per node-hour x hours lost per interruption)
        x (1 + capacity.cross_az_penalty, for a pool outside the job's zone)

The interruption rate blends the fleet's own history with a Spot Advisor prior; a pool that
cannot be bought is listed with its reason (docs/DESIGN.md "Placement and deadlines").
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from fleetd.config import CapacityConfig
from fleetd.policy.model import Market, PoolId, PoolOffer
from fleetd.policy.observation import PoolStats

# Spot Advisor "frequency of interruption" buckets: share of instances interrupted over a month.
# We use each bucket's midpoint (25 % for the open ">20%" bucket).
BUCKET_MONTHLY_SHARE = (0.025, 0.075, 0.125, 0.175, 0.25)
HOURS_PER_MONTH = 730.0
NOTICE_LEAD_S = 120.0  # AWS: a spot interruption notice comes ~2 minutes before the reclaim


@dataclass(frozen=True, slots=True)
class AdvisorRow:
    """One row of the Spot Advisor table (fleetd.adapters.spot_advisor reads the CSV)."""

    region: str
    instance_type: str
    savings_pct: float
    bucket_index: int
    bucket_label: str


def prior_rate_for_bucket(bucket_index: int) -> float:
    """Interruptions per node-hour implied by a Spot Advisor bucket index (0..4)."""
    if not 0 <= bucket_index < len(BUCKET_MONTHLY_SHARE):
        raise ValueError(f"Spot Advisor bucket index {bucket_index} is not in 0..4")
    return BUCKET_MONTHLY_SHARE[bucket_index] / HOURS_PER_MONTH


def region_of_zone(zone: str) -> str:
    """'us-east-1a' -> 'us-east-1' (a zone is its region plus a letter)."""
    return re.sub(r"[a-z]+$", "", zone)


def priors_for_pools(rows: Iterable[AdvisorRow], pools: Iterable[PoolId]) -> dict[PoolId, float]:
    """Prior interruptions per node-hour for every pool the table knows (by region and type)."""
    table = {(r.region, r.instance_type): r.bucket_index for r in rows}
    out: dict[PoolId, float] = {}
    for pool in pools:
        bucket = table.get((region_of_zone(pool.zone), pool.instance_type))
        if bucket is not None:
            out[pool] = prior_rate_for_bucket(bucket)
    return out


def interruption_rate(stats: PoolStats | None, cfg: CapacityConfig) -> tuple[float, str]:
    """Expected interruptions per node-hour, and how it was derived (for the reason string)."""
    if stats is None:
        return 0.0, "no history, no prior"
    events = stats.notices + stats.losses
    prior = stats.prior_interruptions_per_hour
    if prior is None:
        if stats.node_hours <= 0:
            return 0.0, "no history, no prior"
        rate = events / stats.node_hours
        return rate, f"{events} interruptions in {stats.node_hours:.1f} node-h"
    # Gamma-Poisson posterior mean: the prior counts as ``prior_weight_node_hours`` of experience, so
    # a pool run for long is judged by what it did to us, a new one by what AWS says about it.
    weight = cfg.prior_weight_node_hours
    rate = (events + prior * weight) / (stats.node_hours + weight)
    return rate, (f"{events} interruptions in {stats.node_hours:.1f} node-h blended with prior {prior:.4f}/h")


@dataclass(frozen=True, slots=True)
class RankedPool:
    offer: PoolOffer
    market: Market
    price_per_hour: float
    interruptions_per_hour: float
    score: float  # expected USD per useful GPU-hour
    reason: str

    @property
    def pool(self) -> PoolId:
        return self.offer.pool


def is_interrupting_now(stats: PoolStats | None, now: float, window_s: float) -> bool:
    return stats is not None and stats.last_notice_at is not None and now - stats.last_notice_at <= window_s


def rank_pools(
    offers: Iterable[PoolOffer],
    stats: Mapping[PoolId, PoolStats],
    cfg: CapacityConfig,
    now: float,
    market: Market,
    avoid: frozenset[PoolId] = frozenset(),
    reform_cost_h: float = 0.0,
    fleet_zone: str | None = None,
) -> tuple[list[RankedPool], list[str]]:
    """Pools that can be bought on ``market`` now, best first; and why the others cannot.

    ``reform_cost_h``: node-hours of training the whole fleet loses to the re-forms one
    interruption causes (the leave and the replacement's join). ``fleet_zone``: the zone the
    job trains in (None: the best pool's zone), for the cross-AZ penalty. A pool interrupting
    now, or one whose node is at risk (``avoid``), is a last resort: ranked only when no other
    pool is, since idling loses the time for sure and a new node there only risks it.
    """
    ranked: list[RankedPool] = []
    last_resort: list[RankedPool] = []
    skipped: list[str] = []
    soft: list[str] = []
    for offer in offers:
        s = stats.get(offer.pool)
        unusable = _unusable(offer, s, cfg, now, market)
        if unusable:
            skipped.append(f"{offer.pool}: {unusable}")
            continue
        entry = _score(offer, s, cfg, market, reform_cost_h)
        held_back = _held_back(offer.pool, s, cfg, now, market, avoid)
        if held_back:
            soft.append(f"{offer.pool}: {held_back}")
            last_resort.append(replace(entry, reason=f"last resort, {held_back}: {entry.reason}"))
        else:
            ranked.append(entry)
    if ranked:
        skipped.extend(soft)
    else:
        ranked = last_resort
    ranked = _cross_az(ranked, cfg, fleet_zone)
    ranked.sort(key=lambda r: (r.score, r.price_per_hour, str(r.pool)))
    return ranked, skipped


def _unusable(offer: PoolOffer, s: PoolStats | None, cfg: CapacityConfig, now: float, market: Market) -> str:
    """Why the pool cannot be bought at all now ("" if it can)."""
    until = None
    if s is not None:
        until = s.capacity_error_until if market is Market.SPOT else s.on_demand_capacity_error_until
    if until is not None and until > now:
        return f"capacity error, unavailable for another {until - now:.0f} s"
    excluded = _excluded(offer, cfg, market)
    if excluded:
        return excluded
    wave = reclaim_wave_left_s(s, now)
    if market is Market.SPOT and wave > 0:
        assert s is not None and s.last_notice_at is not None  # a wave is left only after a notice
        return (
            f"reclaim wave under way (notice {now - s.last_notice_at:.0f} s ago; a node "
            f"bought now would likely be reclaimed with it), usable as a last resort in {wave:.0f} s"
        )
    return ""


def _held_back(
    pool: PoolId, s: PoolStats | None, cfg: CapacityConfig, now: float, market: Market, avoid: frozenset[PoolId]
) -> str:
    """Why the pool is only a last resort ("" if it is not)."""
    if pool in avoid:
        return "its node is at risk"
    if market is Market.SPOT and is_interrupting_now(s, now, cfg.interrupting_window_s):
        assert s is not None and s.last_notice_at is not None  # interrupting only after a notice
        return f"interrupting now (notice {now - s.last_notice_at:.0f} s ago)"
    return ""


def _score(
    offer: PoolOffer, s: PoolStats | None, cfg: CapacityConfig, market: Market, reform_cost_h: float
) -> RankedPool:
    """Dollars per useful GPU-hour, interruptions and what each costs included."""
    pool = offer.pool
    if market is Market.ON_DEMAND:
        price = offer.on_demand_price
        rate, rate_why = 0.0, "on-demand is not interrupted"
    else:
        price = offer.spot_price  # type: ignore[assignment]
        rate, rate_why = interruption_rate(s, cfg)
    units = offer.gpus * offer.relative_throughput
    per_unit = price / units
    lost_h = cfg.interruption_cost_h + reform_cost_h
    score = per_unit * (1.0 + rate * lost_h)
    return RankedPool(
        offer=offer,
        market=market,
        price_per_hour=price,
        interruptions_per_hour=rate,
        score=score,
        reason=(
            f"{pool} {market.value} ${price:.3f}/h for {offer.gpus} GPU x "
            f"{offer.relative_throughput:g} A10G-equivalent (${per_unit:.3f}/useful GPU-h), "
            f"{rate:.4f} interruptions/h ({rate_why}) x {lost_h:.2f} h lost each "
            f"-> ${score:.3f} per useful GPU-h"
        ),
    )


def reclaim_wave_left_s(stats: PoolStats | None, now: float) -> float:
    """Seconds until the reclaim wave of the pool's last notice is over: AWS gives its notice
    ~2 minutes ahead, so capacity bought in that pool before then is likely taken back with it."""
    if stats is None or stats.last_notice_at is None:
        return 0.0
    return max(0.0, stats.last_notice_at + NOTICE_LEAD_S - now)


def _excluded(offer: PoolOffer, cfg: CapacityConfig, market: Market) -> str:
    """Why ``offer`` cannot be bought on ``market`` at all ("" if it can)."""
    if offer.gpus <= 0:
        return "no GPUs"
    if not offer.relative_throughput > 0:
        return "no training throughput known for its GPU model"
    if not offer.on_demand_price or offer.on_demand_price <= 0:
        return "no on-demand price (spot bids and savings are judged against it)"
    if market is Market.ON_DEMAND:
        return ""
    if offer.spot_price is None:
        return "no spot price"
    if offer.spot_price >= offer.on_demand_price:
        return f"spot ${offer.spot_price:.3f}/h is not below on-demand ${offer.on_demand_price:.3f}/h"
    if cfg.max_spot_price_per_hour is not None and offer.spot_price > cfg.max_spot_price_per_hour:
        return f"spot ${offer.spot_price:.3f}/h above max_spot_price_per_hour ${cfg.max_spot_price_per_hour:.3f}/h"
    return ""


def _cross_az(ranked: list[RankedPool], cfg: CapacityConfig, fleet_zone: str | None) -> list[RankedPool]:
    """One synchronous job trains in one zone: a pool elsewhere costs (1 + cross_az_penalty)
    times its score (config.py: inter-AZ transfer of the all-reduce, and the slower link)."""
    if not ranked or cfg.cross_az_penalty <= 0:
        return ranked
    zone = fleet_zone or min(ranked, key=lambda r: (r.score, r.price_per_hour, str(r.pool))).pool.zone
    factor = 1.0 + cfg.cross_az_penalty
    return [
        r
        if r.pool.zone == zone
        else replace(
            r,
            score=r.score * factor,
            reason=f"{r.reason}; x {factor:g} outside the job's zone {zone} (cross_az_penalty) "
            f"-> ${r.score * factor:.3f}",
        )
        for r in ranked
    ]


def diversify(ranked: list[RankedPool], cfg: CapacityConfig) -> list[RankedPool]:
    """Up to max_pools_per_launch pools near the best score, spread over types and zones.

    One CreateFleet request over several pools lets EC2's price-capacity-optimized strategy dodge a
    pool that is short of capacity, and spreading over zones and types keeps one reclaim wave from
    taking the whole fleet. Pools much worse than the best (diversify_within) are never added.
    """
    if not ranked:
        return []
    limit = ranked[0].score * cfg.diversify_within
    candidates = [r for r in ranked if r.score <= limit]
    chosen = [candidates[0]]
    rest = candidates[1:]
    while rest and len(chosen) < cfg.max_pools_per_launch:
        zones = {c.pool.zone for c in chosen}
        types = {c.pool.instance_type for c in chosen}
        # Most novel first; among equally novel, the better score (rest is sorted by score).
        best = max(rest, key=functools.partial(_novelty, zones=zones, types=types))
        chosen.append(best)
        rest.remove(best)
    return chosen


def _novelty(r: RankedPool, zones: set[str], types: set[str]) -> int:
    """How many of a pool's zone and instance type the chosen pools do not have yet (0-2)."""
    return (r.pool.zone not in zones) + (r.pool.instance_type not in types)
