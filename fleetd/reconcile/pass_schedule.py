"""Which pass next when the loop is woken: an urgent pass now, none, or after the full pass.

Pure (plain data in, ``now`` passed in): the loop (loop.py) reads its clock and the registry's
notice count and does what this says.

- Notices fold: the urgent pass plans for every notice the registry counted since the last plan
  (full or urgent), so all the notices that arrived while one urgent pass ran are taken by ONE
  following urgent pass, not one pass each. A wake-up with no new notice (a status, a finished
  EC2 call) runs none: the full pass will see it.
- A full pass cannot be starved: the urgent passes beside one running full pass may take at
  most ``max_share`` of the time since it started; past that the next one waits until the
  share is back under it (``resume_at``), or for the full pass's end if sooner. So a full pass
  takes at most 1 / (1 - max_share) times as long as it would alone, and a notice waits for an
  urgent pass at most about as long as the last urgent passes took. Seen on a loaded 2-core box
  at 2,000 nodes (bench/agents_load.py, fleetd at 12 % of a core): with a notice every 2 s and
  each urgent pass re-planning the fleet in more than that, urgent passes ran back to back for
  ~90 s beside a full pass that could not finish. A first rule (at most 3 urgent passes, none
  after 5 s of the full pass) held notices 9-13 s behind full passes that were only waiting on
  EC2's listing, and was replaced by this share.
- Full passes a wake-up asks for take at most ``FullPassLimits.max_share`` of the loop: the next
  one starts no sooner than the last one's own duration x (1 - share) / share after it ended
  (``woken_full_pass_at``); a notice meanwhile still gets its urgent pass at once. At fleet scale
  news other than notices (statuses, finished EC2 calls) wakes the loop several times a second,
  and each full pass re-reads and re-plans 2,000 nodes (~1 s on a loaded 2-core box): back to
  back, they took the loop (71-96 full passes in 120 s with a 10 s interval, bench/agents_load.py)
  and urgent passes queued behind them. A pass on its interval or a re-plan the planner asked for
  (``replan_in_s``) is not held.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Step = Literal["urgent", "skip", "defer"]


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
