"""Notices and rebalance recommendations (pure).

A notice drains its node (coordinated checkpoint, upload, leave) before its deadline; the
replacement comes through the normal capacity path. A recommendation is a risk signal, not a
drain: pre-buy a replacement (budget and hourly churn cap allowing), ask for a checkpoint if the
last durable one is old, keep the node training; it expires (docs/DESIGN.md "Rebalance
recommendations expire").
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetd.config import FleetdConfig
from fleetd.policy.model import Drain, LaunchPurpose, Market, Node, PoolId, RequestCheckpoint


def notice_drains(kept: list[Node], now: float) -> list[Drain]:
    drains = []
    for node in kept:
        if node.notice_at is None:
            continue
        if node.notice_deadline is not None:
            left = f"{node.notice_deadline - now:.0f} s before AWS acts"
        else:
            left = "deadline unknown"
        drains.append(
            Drain(
                reason=(
                    f"interruption notice for {node.instance_id} ({node.pool}) "
                    f"{now - node.notice_at:.0f} s ago, {left}: checkpoint, upload, leave"
                ),
                instance_id=node.instance_id,
                deadline=node.notice_deadline,
            )
        )
    return drains


def wave_settling(nodes: tuple[Node, ...] | list[Node], now: float, quiet_s: float, max_s: float) -> float | None:
    """Seconds to wait before buying replacements for a wave of notices still coming in: a notice
    arrived less than ``quiet_s`` ago, and the wave's first is less than ``max_s`` old. None: buy
    now. One wave, one purchase (one CreateFleet) instead of one per pass that saw a notice."""
    times = [n.notice_at for n in nodes if n.notice_at is not None]
    if not times or quiet_s <= 0:
        return None
    newest = max(times)
    first = min(t for t in times if t >= newest - max_s)  # the wave the newest notice belongs to
    wait = min(newest + quiet_s, first + max_s) - now
    return wait if wait > 0 else None


@dataclass(frozen=True, slots=True)
class RiskPlan:
    at_risk: tuple[Node, ...]
    covered: int  # at-risk nodes already covered by an extra node beyond the target
    prebuy: int  # new replacements to pre-buy now
    avoid: frozenset[PoolId]  # do not buy the replacement where the risk is
    notes: tuple[str, ...]
    expired: tuple[Node, ...] = ()  # recommendations that saw no notice within the window
    # Nodes pre-bought for an expired recommendation: the first to go when the fleet is above
    # its target (the extra capacity the recommendation caused).
    release: frozenset[str] = frozenset()


def expired_recommendations(kept: list[Node], now: float, expiry_s: float) -> tuple[Node, ...]:
    """Nodes whose rebalance recommendation saw no notice within ``expiry_s``."""
    return tuple(
        n for n in kept if n.rebalance_at is not None and n.notice_at is None and now - n.rebalance_at >= expiry_s
    )


def prebought_for(expired: tuple[Node, ...], kept: list[Node]) -> frozenset[str]:
    """The node each expired recommendation pre-bought: the newest spot node launched after it
    for a pre-buy (one per recommendation; not a node that is itself at risk). The launch's
    recorded purpose decides; a node whose purpose is unknown (bought before the state recorded
    it) is judged by launch order alone, and a node bought for another purpose (a scale-up, a
    loss's replacement in the same second) is never taken for a pre-buy: EC2's LaunchTime has
    whole seconds, so order alone confuses launches of one pass."""
    risky = {n.instance_id for n in kept if n.rebalance_at is not None}
    taken: set[str] = set()
    for node in sorted(expired, key=lambda n: (n.rebalance_at or 0.0, n.instance_id)):
        assert node.rebalance_at is not None
        later = [
            n
            for n in kept
            if n.instance_id not in risky
            and n.instance_id not in taken
            and n.market is Market.SPOT
            and n.launched_at >= node.rebalance_at
            and n.launch_purpose in (None, LaunchPurpose.REBALANCE_PREBUY)
        ]
        if later:
            taken.add(
                max(
                    later,
                    key=lambda n: (n.launch_purpose is LaunchPurpose.REBALANCE_PREBUY, n.launched_at, n.instance_id),
                ).instance_id
            )
    return frozenset(taken)


def plan_risk(
    kept: list[Node],
    target: int,
    prebuys_last_hour: int,
    budget_allows_prebuy: bool,
    cfg: FleetdConfig,
    now: float,
) -> RiskPlan:
    """Pre-buys for nodes with a live rebalance recommendation (no notice, not expired)."""
    window = cfg.rebalance.recommendation_expiry_s
    expired = expired_recommendations(kept, now, window)
    gone = {n.instance_id for n in expired}
    at_risk = tuple(n for n in kept if n.rebalance_at is not None and n.notice_at is None and n.instance_id not in gone)
    release = prebought_for(expired, kept) if len(kept) > target else frozenset()
    expiry_notes: tuple[str, ...] = ()
    if expired:
        ids = ", ".join(n.instance_id for n in expired)
        what = (
            f"releasing the extra node it caused ({', '.join(sorted(release))})"
            if release
            else "no extra node of its to release"
        )
        expiry_notes = (
            f"rebalance recommendation for {ids} expired: no notice within "
            f"recommendation_expiry_s={window:.0f}; {what}; scaling judged again at the target",
        )
    if not at_risk:
        return RiskPlan((), 0, 0, frozenset(), expiry_notes, expired, release)
    extras = max(0, len(kept) - target)
    covered = min(len(at_risk), extras)
    uncovered = len(at_risk) - covered
    cap = cfg.rebalance.max_recommendation_replacements_per_hour
    # The cap counts the last hour's pre-buys whether or not their recommendation expired.
    churn_left = max(0, cap - prebuys_last_hour)
    ids = ", ".join(n.instance_id for n in at_risk)
    notes = [f"rebalance recommendation for {ids}: at risk, kept training until a real notice"]
    prebuy = 0
    if uncovered:
        if not budget_allows_prebuy:
            notes.append(f"not pre-buying {uncovered} replacement(s): budget level forbids it")
        elif churn_left == 0:
            notes.append(
                f"not pre-buying {uncovered} replacement(s): {prebuys_last_hour} pre-buys in the "
                f"last hour reached max_recommendation_replacements_per_hour={cap}"
            )
        else:
            prebuy = min(uncovered, churn_left)
            if prebuy < uncovered:
                notes.append(
                    f"pre-buying {prebuy} of {uncovered}: churn cap max_recommendation_replacements_per_hour={cap}"
                )
    return RiskPlan(
        at_risk,
        covered,
        prebuy,
        frozenset(n.pool for n in at_risk),
        expiry_notes + tuple(notes),
        expired,
        release,
    )


def checkpoint_if_stale(
    *,
    why: str,
    last_durable_at: float | None,
    last_request_at: float | None,
    max_age_s: float,
    retry_s: float,
    now: float,
) -> tuple[RequestCheckpoint | None, str]:
    """A checkpoint request when the last durable one is too old (and none is in flight)."""
    if last_durable_at is not None and now - last_durable_at <= max_age_s:
        return None, (
            f"{why}: last durable checkpoint {now - last_durable_at:.0f} s old "
            f"(<= max_checkpoint_age_s {max_age_s:.0f}), no checkpoint needed"
        )
    if last_request_at is not None and now - last_request_at < retry_s:
        return None, (f"{why}: checkpoint requested {now - last_request_at:.0f} s ago, waiting for it")
    age = (
        "no durable checkpoint yet"
        if last_durable_at is None
        else (f"last durable checkpoint {now - last_durable_at:.0f} s old > max_checkpoint_age_s {max_age_s:.0f}")
    )
    return RequestCheckpoint(reason=f"{why}: {age}"), ""
