"""``/etc/fleetd/team.toml``: one team budget over several jobs' daemons (``fleetd team``).

    [team]
    name = "research"
    total_usd = 2000           # the whole team's, over every job, ever
    max_usd_per_hour = 40      # the whole team's burn
    [[jobs]]
    name = "prod"              # the job's fleet (fleetd@prod, /etc/fleetd/prod.toml)
    config = "/etc/fleetd/prod.toml"
    state_dir = "/var/lib/fleetd/prod"   # what fleetd@prod uses
    priority = 10              # higher first when money or capacity is short
    max_usd_per_hour = 25      # optional caps of its own, under the team's

Each job's own config sets ``[team] member = true``; its ``[budget]`` stays an upper bound of its
own (the share it runs under is the smaller of the two).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, model_validator

from fleetd.shared.settings import FileSettings, Group, LoggingConfig, Name, load_settings

DEFAULT_TEAM_PATH = Path("/etc/fleetd/team.toml")
PositiveUsd = Annotated[float, Field(gt=0)]
Share = Annotated[float, Field(ge=0, le=1)]


class TeamGroup(Group):
    name: Name = "team"
    total_usd: PositiveUsd
    max_usd_per_hour: PositiveUsd
    # The allocator's forecast horizon: the burn it allots over this never crosses what is left.
    # Keep it equal to the jobs' budget.forecast_horizon_s (both default to an hour).
    horizon_s: Annotated[float, Field(gt=0)] = 3600.0
    # How often the arbiter allots (it also writes the allotments it keeps).
    interval_s: Annotated[float, Field(gt=0)] = 30.0
    # The allocator's knobs (fleetd/policy/team_model.py TeamSettings).
    extra_priority_band: Share = 0.3
    resume_margin: Annotated[float, Field(ge=0)] = 0.5
    min_pause_s: Annotated[float, Field(ge=0)] = 1800.0
    changeover_s: Annotated[float, Field(ge=0)] = 900.0
    # A move's copy, per GB across regions (S3 inter-region transfer; AWS lists $0.02 between most).
    transfer_usd_per_gb: Annotated[float, Field(ge=0)] = 0.02
    # Other regions' spot prices are fetched at most this often.
    price_refresh_s: Annotated[float, Field(gt=0)] = 300.0
    # /metrics of the team's loop (spend, budget, each job's allotment); 0: none.
    metrics_host: str = "127.0.0.1"
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 9470


class TeamJobEntry(Group):
    name: Name
    config: Path
    # The job daemon's state directory, when its unit sets it apart from its config (fleetd@NAME
    # sets /var/lib/fleetd/NAME through FLEETD_FLEET__STATE_DIR). Unset: the config's state_dir.
    state_dir: Path | None = None
    priority: int = 0
    total_usd: PositiveUsd | None = None
    max_usd_per_hour: PositiveUsd | None = None
    # The job's checkpoint size, for what a move to another region would cost to copy.
    checkpoint_gb: Annotated[float, Field(ge=0)] = 10.0


class TeamConfig(FileSettings):
    team: TeamGroup
    jobs: tuple[TeamJobEntry, ...]
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="after")
    def _jobs(self) -> TeamConfig:
        if not self.jobs:
            raise ValueError("a team needs at least one [[jobs]] entry")
        names = [j.name for j in self.jobs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"job names must be unique: {', '.join(twice)}")
        return self


def load_team(path: Path | None = DEFAULT_TEAM_PATH) -> TeamConfig:
    return load_settings(TeamConfig, path)
