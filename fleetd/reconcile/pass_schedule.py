"""Which pass next when the loop is woken: an urgent pass now, none, or after the full pass.

Pure (plain data in, ``now`` passed in): the loop (loop.py) reads its clock and the registry's
notice count and does what this says.

- Notices fold: the urgent pass plans for every notice the registry counted since the last plan
  (full or urgent), so all the notices that arrived while one urgent pass ran are taken by ONE
  following urgent pass, not one pass each. A wake-up with no new notice (a status, a finished
  EC2 call) runs none: the full pass will see it.
- A full pass cannot be starved: beside one running full pass at most ``max_beside_full``
  urgent passes run, and none once it has run ``max_full_age_s``. After that a notice waits for
  the full pass to end (which drains it too when it observed after the notice), and one urgent
  pass follows it. Seen on a loaded 2-core box at 2,000 nodes (bench/agents_load.py, fleetd at
  12 % of a core): with a notice every 2 s and each urgent pass re-planning the fleet in more than
  that, urgent passes ran back to back for ~90 s beside a full pass that could not finish.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Step = Literal["urgent", "skip", "defer"]


@dataclass(frozen=True, slots=True)
class UrgentLimits:
    max_beside_full: int = 3  # urgent passes beside one full pass
    max_full_age_s: float = 5.0  # a full pass running this long finishes before the next one


def urgent_step(*, notices_seen: int | None, notices_planned: int | None, full_started_at: float | None,
                urgent_beside_full: int, now: float, limits: UrgentLimits = UrgentLimits()) -> Step:
    """``notices_seen``: the registry's count of notices (None: an observer that does not count,
    every wake-up is news); ``notices_planned``: that count as of the last plan;
    ``full_started_at``: when the running full pass started (None: none runs);
    ``urgent_beside_full``: urgent passes already run beside it."""
    if notices_seen is not None and notices_seen == notices_planned:
        return "skip"
    if full_started_at is None:
        return "urgent"
    if urgent_beside_full >= limits.max_beside_full or now - full_started_at >= limits.max_full_age_s:
        return "defer"
    return "urgent"
