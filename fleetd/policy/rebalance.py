"""Notices and rebalance recommendations.

- An interruption notice is the real thing: drain the node (coordinated checkpoint, upload its
  shard, leave the rendezvous) before the notice deadline; a replacement is bought through the
  normal capacity path because the node no longer counts toward the target.
- A rebalance recommendation is a risk signal, not a drain: pre-buy a replacement if the budget
  allows and the hourly churn cap is not used up, ask for a checkpoint if the last durable one is
  older than rebalance.max_checkpoint_age_s, and keep the node training until a real notice.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetd.config import FleetdConfig
from fleetd.policy.model import Drain, Node, PoolId, RequestCheckpoint


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


@dataclass(frozen=True, slots=True)
class RiskPlan:
    at_risk: tuple[Node, ...]
    covered: int  # at-risk nodes already covered by an extra node beyond the target
    prebuy: int  # new replacements to pre-buy now
    avoid: frozenset[PoolId]  # do not buy the replacement where the risk is
    notes: tuple[str, ...]


def plan_risk(
    kept: list[Node],
    target: int,
    prebuys_last_hour: int,
    budget_allows_prebuy: bool,
    cfg: FleetdConfig,
) -> RiskPlan:
    """Pre-buys for nodes with a rebalance recommendation (and no notice)."""
    at_risk = tuple(n for n in kept if n.rebalance_at is not None and n.notice_at is None)
    if not at_risk:
        return RiskPlan((), 0, 0, frozenset(), ())
    extras = max(0, len(kept) - target)
    covered = min(len(at_risk), extras)
    uncovered = len(at_risk) - covered
    cap = cfg.rebalance.max_recommendation_replacements_per_hour
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
                    f"pre-buying {prebuy} of {uncovered}: churn cap "
                    f"max_recommendation_replacements_per_hour={cap}"
                )
    return RiskPlan(
        at_risk, covered, prebuy, frozenset(n.pool for n in at_risk), tuple(notes)
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
        return None, (
            f"{why}: checkpoint requested {now - last_request_at:.0f} s ago, waiting for it"
        )
    age = "no durable checkpoint yet" if last_durable_at is None else (
        f"last durable checkpoint {now - last_durable_at:.0f} s old > max_checkpoint_age_s "
        f"{max_age_s:.0f}"
    )
    return RequestCheckpoint(reason=f"{why}: {age}"), ""
