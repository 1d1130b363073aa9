"""What the team must keep aside before it splits its money (pure): the team stays inside its
total even if its loop stops, so every dollar a job may still spend is counted before the rest
is shared.

- A job the team plans for this pass claims its spend plus the tail it is committed to: at its
  current burn, the time until its daemon reads a lower allotment and a stop finishes (its stop
  reserve, two of its passes and one of the team's).
- A job the team does not plan for (unreadable, status stale, no priced pool, not a member) keeps
  what it may already spend: the larger of its spend and the total it was last allotted, at the
  larger of its burn and the burn it was allotted. A job that does not follow the team (not a
  member) claims what its own budget lets it spend.
- A job that is over claims its spend; it is written a zero share, so a new run of it waits for
  the team instead of running on an old one.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetd.team.inputs import JobSeen

STALE_PASSES = 3  # status.json older than this many of its daemon's passes (+30 s): the daemon is not running


@dataclass(frozen=True, slots=True)
class Claim:
    spent_usd: float  # spent, or the most it may have spent by the time a lower allotment holds
    burn_usd_per_hour: float  # what it may burn meanwhile (counts against the team's per-hour cap)


def spend_known(seen: JobSeen) -> bool:
    snap = seen.snapshot
    return snap is not None and snap.budget is not None


def stale_for_s(seen: JobSeen, now: float) -> float | None:
    """How long the job's status is past due (None: fresh, or no status at all)."""
    snap = seen.snapshot
    if snap is None:
        return None
    late = now - snap.written_at - (STALE_PASSES * snap.reconcile_interval_s + 30.0)
    return late if late > 0 else None


def planned_claim(seen: JobSeen, team_interval_s: float) -> Claim:
    """A job planned this pass: its spend and its committed tail (see the module docstring)."""
    assert seen.snapshot is not None and seen.snapshot.budget is not None and seen.cfg is not None
    burn = seen.snapshot.budget.burn_usd_per_hour
    tail_s = seen.cfg.budget.stop_reserve_s + 2 * seen.cfg.fleet.reconcile_interval_s + team_interval_s
    return Claim(seen.snapshot.budget.spent_usd + burn * tail_s / 3600.0, burn)


def kept_claim(seen: JobSeen) -> Claim:
    """A job not planned this pass: what it may already spend (see the module docstring)."""
    known = spend_known(seen)
    spent = seen.spent_usd if known else 0.0
    burn = seen.snapshot.budget.burn_usd_per_hour if known and seen.snapshot and seen.snapshot.budget else 0.0
    if seen.over and known:
        return Claim(spent, 0.0)
    if seen.cfg is not None and not seen.cfg.team.member:
        return Claim(max(spent, seen.cfg.budget.total_usd), max(burn, seen.cfg.budget.max_usd_per_hour))
    prev = seen.previous
    return Claim(
        max(spent, prev.total_usd if prev is not None else 0.0),
        max(burn, prev.usd_per_hour if prev is not None else 0.0),
    )
