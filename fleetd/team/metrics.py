"""The team's loop on ``/metrics`` (``[team] metrics_port``): what the team spent and may spend,
and each job's allotment, as of the last pass. A job whose spend is unknown (its status cannot be
read) has no spend sample rather than a made-up 0."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from fleetd.metrics import merged
from fleetd.policy.team_share import NOT_TRAINING

if TYPE_CHECKING:
    from fleetd.team.team_pass import TeamPass


class TeamMetrics:
    def __init__(self, team: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, t = self.registry, ["team"]
        self.team = team
        self.spent = Gauge("fleetd_team_spent_usd", "Spend of every job of the team so far", t, registry=r)
        self.budget = Gauge("fleetd_team_budget_usd", "The team's total budget", t, registry=r)
        self.cap = Gauge("fleetd_team_max_usd_per_hour", "The team's cap on its burn", t, registry=r)
        self.burn = Gauge("fleetd_team_allotted_usd_per_hour", "The burn allotted to the team's jobs", t, registry=r)
        self.room = Gauge("fleetd_team_room_usd_per_hour", "What the team may burn this pass", t, registry=r)
        self.last = Gauge(
            "fleetd_team_last_pass_timestamp_seconds", "When the team's loop last allotted", t, registry=r
        )
        j = ["team", "job"]
        self.nodes = Gauge("fleetd_team_job_allotted_nodes", "Nodes a job may run", j, registry=r)
        self.usd = Gauge("fleetd_team_job_allotted_usd_per_hour", "A job's allotted burn", j, registry=r)
        self.total = Gauge("fleetd_team_job_allotted_total_usd", "What a job may have spent in all", j, registry=r)
        self.paused = Gauge("fleetd_team_job_waiting", "1 while a job is paused or pending", j, registry=r)
        self.job_spent = Gauge("fleetd_team_job_spent_usd", "A job's spend as its daemon last wrote it", j, registry=r)
        self.unknown = Gauge(
            "fleetd_team_spend_unknown_jobs", "Jobs whose spend is unknown (team spend is a lower bound)", t, registry=r
        )

    def observe(self, done: TeamPass, *, total_usd: float, max_usd_per_hour: float, now: float) -> None:
        team = self.team
        self.spent.labels(team).set(done.spent_usd)
        self.budget.labels(team).set(total_usd)
        self.cap.labels(team).set(max_usd_per_hour)
        if done.plan is not None:
            self.burn.labels(team).set(done.plan.burn_usd_per_hour)
            self.room.labels(team).set(done.plan.room_usd_per_hour)
        self.last.labels(team).set(now)
        for record in done.written:
            self.nodes.labels(team, record.job).set(record.nodes)
            self.usd.labels(team, record.job).set(record.usd_per_hour)
            self.total.labels(team, record.job).set(record.total_usd)
            self.paused.labels(team, record.job).set(1.0 if record.kind in NOT_TRAINING else 0.0)
        unknown = set(done.spend_unknown)
        self.unknown.labels(team).set(len(unknown))
        for seen in done.seen:
            if seen.entry.name not in unknown:
                self.job_spent.labels(team, seen.entry.name).set(seen.spent_usd)
            else:
                with contextlib.suppress(KeyError):  # no sample rather than a stale one
                    self.job_spent.remove(team, seen.entry.name)

    def render(self, also: Sequence[CollectorRegistry] = ()) -> bytes:
        return generate_latest(merged((self.registry, *also)))
