"""``<fleet.state_dir>/region.json``: the region a team job runs in when the team moved it away
from its config's ``[aws] region`` (fleetd/team/region_move.py writes it, last, once the job's
objects are in the new region's bucket).

``fleetd run`` and the team's loop read the job's config through `effective_config`, so both see
the job where its checkpoints are. The file, not the config, is the truth after a move: the
operator's config stays as written, and a restart of the daemon (or of the host) carries on in
the region the checkpoint was copied to. A record naming a region the config no longer lists is
an error, never a silent return home: the newest checkpoint is in that region's bucket.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleetd.atomic_file import read_model, write_atomically
from fleetd.config import FleetdConfig, RegionSettings
from fleetd.protocol.errors import ProtocolError

REGION_VERSION = 1
REGION_NAME = "region.json"


class RegionRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    schema_version: int = REGION_VERSION
    job: str
    region: str
    moved_from: str
    moved_at: float  # epoch seconds, when the copy ended
    objects: Annotated[int, Field(ge=0)]
    bytes: Annotated[int, Field(ge=0)]
    copy_s: Annotated[float, Field(ge=0)]
    reason: str = ""

    @field_validator("schema_version")
    @classmethod
    def _known(cls, v: int) -> int:
        if v > REGION_VERSION:
            raise ValueError(f"region record schema {v} is newer than this fleetd ({REGION_VERSION})")
        return v


class RegionError(Exception):
    """The job's region cannot be settled from its config and its region record."""


def read_region(state_dir: Path) -> RegionRecord | None:
    """None when the job never moved; ProtocolError when the file is not a valid record."""
    return read_model(Path(state_dir) / REGION_NAME, RegionRecord)


def write_region(state_dir: Path, record: RegionRecord) -> Path:
    return write_atomically(Path(state_dir) / REGION_NAME, record.model_dump_json(indent=1).encode(), mode=0o640)


def allowed_regions(cfg: FleetdConfig) -> tuple[str, ...]:
    """The config's own region first, then the others it lists."""
    home = cfg.aws.region
    return (home, *(r.region for r in cfg.team.regions if r.region != home))


def in_region(cfg: FleetdConfig, region: str) -> FleetdConfig:
    """``cfg`` as it runs in ``region``: unchanged for its own region, else with the settings of
    its [[team.regions]] entry (region, bucket, AMI, subnets, security groups, instance profile,
    launch template)."""
    if region == cfg.aws.region:
        return cfg
    entries = _with_home(cfg)
    entry = next((r for r in entries if r.region == region), None)
    if entry is None:
        raise RegionError(f"region {region} is not one of the job's ({', '.join(allowed_regions(cfg))})")
    cap = cfg.capacity.model_copy(
        update={
            "ami_id": entry.ami_id,
            "subnet_ids": entry.subnet_ids,
            "security_group_ids": entry.security_group_ids,
            "instance_profile_arn": entry.instance_profile_arn,
            "launch_template": entry.launch_template,
            # Zones named for the home region mean nothing in another: the region's own are used.
            "zones": tuple(z for z in cfg.capacity.zones if z.startswith(region)),
        }
    )
    return cfg.model_copy(
        update={
            "aws": cfg.aws.with_region(region, f"team move ({REGION_NAME})"),
            "checkpoints": cfg.checkpoints.model_copy(update={"bucket": entry.bucket}),
            "capacity": cap,
            # The region it left is listed too, with its own settings: the job can move back.
            "team": cfg.team.model_copy(update={"regions": entries}),
        }
    )


def _with_home(cfg: FleetdConfig) -> tuple[RegionSettings, ...]:
    """[[team.regions]] plus the region ``cfg`` runs in now, with its settings, unless listed."""
    if any(r.region == cfg.aws.region for r in cfg.team.regions):
        return cfg.team.regions
    cap = cfg.capacity
    here = RegionSettings(
        region=cfg.aws.region,
        bucket=cfg.checkpoints.bucket,
        ami_id=cap.ami_id,
        subnet_ids=cap.subnet_ids,
        security_group_ids=cap.security_group_ids,
        instance_profile_arn=cap.instance_profile_arn,
        launch_template=cap.launch_template,
    )
    return (here, *cfg.team.regions)


def effective_config(cfg: FleetdConfig) -> FleetdConfig:
    """The job's config in the region it runs in now (its region record's, else its own)."""
    try:
        record = read_region(cfg.fleet.state_dir)
    except ProtocolError as exc:
        raise RegionError(f"{Path(cfg.fleet.state_dir) / REGION_NAME} cannot be read: {exc}") from exc
    if record is None or record.region == cfg.aws.region:
        return cfg
    try:
        return in_region(cfg, record.region)
    except RegionError as exc:
        raise RegionError(
            f"{Path(cfg.fleet.state_dir) / REGION_NAME} says the job moved to {record.region}, which its config "
            f"no longer lists under [[team.regions]]: its newest checkpoint is in that region's bucket. "
            f"List the region again (or remove the file to start over from the checkpoint in "
            f"{cfg.aws.region}): {exc}"
        ) from exc
