"""One pass of the team's loop, as the arbiter, ``fleetd team`` and /metrics see it."""

from __future__ import annotations

from dataclasses import dataclass

from fleetd.policy.team_model import TeamPlan
from fleetd.team.allotment_file import AllotmentRecord
from fleetd.team.claims import spend_known
from fleetd.team.inputs import JobSeen


@dataclass(frozen=True, slots=True)
class TeamPass:
    """One pass: what was read, what was decided, what was written."""

    seen: tuple[JobSeen, ...]
    plan: TeamPlan | None
    written: tuple[AllotmentRecord, ...]
    skipped: dict[str, str]  # job -> why it got no new allotment
    spent_usd: float  # the jobs whose spend is known

    @property
    def spend_unknown(self) -> tuple[str, ...]:
        """Jobs whose spend could not be read: ``spent_usd`` is then a lower bound."""
        return tuple(s.entry.name for s in self.seen if not spend_known(s))
