"""Which pass next when the loop is woken: an urgent pass now, none, or after the full pass.

Pure (plain data in, ``now`` passed in): the loop (loop.py) reads its clock and the registry's
notice count and does what this says. Notices fold: one urgent pass plans every notice counted
since the last plan, and a wake-up with no new notice runs none. Urgent passes take at most a share
of a running full pass's time, and full passes a wake-up asks for at most a share of the loop's
(docs/DESIGN.md "How far one control host goes"; history: docs/measurements/2026-11-load.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Step = Literal["urgent", "skip", "defer"]


# A full pass cannot be starved: with urgent passes beside it, it takes at most
# 1 / (1 - max_share) times as long as alone (docs/measurements/2026-11-load.md).
@dataclass(frozen=True, slots=True)
class UrgentLimits:
    max_share: float = 0.5  # of a running full pass's time, what urgent passes beside it may take


def urgent_step(
    *,
    notices_seen: int | None,
    notices_planned: int | None,
    full_started_at: float | None,
    urgent_busy_s: float,
    now: float,
    limits: UrgentLimits = UrgentLimits(),
) -> Step:
    """``notices_seen``: the registry's count of notices (None: an observer that does not count,
    every wake-up is news); ``notices_planned``: that count as of the last plan;
    ``full_started_at``: when the running full pass started (None: none runs);
    ``urgent_busy_s``: the time urgent passes have taken beside it."""
    if notices_seen is not None and notices_seen == notices_planned:
        return "skip"
    if full_started_at is None:
        return "urgent"
    if urgent_busy_s > limits.max_share * (now - full_started_at):
        return "defer"
    return "urgent"


def resume_at(full_started_at: float, urgent_busy_s: float, limits: UrgentLimits = UrgentLimits()) -> float:
    """When a deferred urgent pass may run: the urgent share of the full pass is back at the limit."""
    return full_started_at + urgent_busy_s / limits.max_share


# At fleet scale statuses and finished EC2 calls wake the loop several times a second; full
# passes back to back took the loop and urgent passes queued behind them. A pass on its
# interval, or a re-plan the planner asked for (``replan_in_s``), is not held.
@dataclass(frozen=True, slots=True)
class FullPassLimits:
    max_share: float = 0.5  # of the loop's time, what full passes started by wake-ups may take


def woken_full_pass_at(
    last_started: float | None, last_ended: float | None, limits: FullPassLimits = FullPassLimits()
) -> float:
    """When a full pass that a wake-up asked for may start (same clock as the arguments): the
    last full pass's duration x (1 - share) / share after it ended; at once if none ran yet."""
    if last_started is None or last_ended is None:
        return float("-inf")
    took = max(0.0, last_ended - last_started)
    return last_ended + took * (1.0 - limits.max_share) / limits.max_share
