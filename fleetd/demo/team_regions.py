"""The team demo's second region (fleetd/demo/team_demo.py): us-west-2 in the same moto, a bucket
and an AMI there, spot capacity withdrawn from us-east-1 by the fault proxy (every pool the demo
buys in answers InsufficientInstanceCapacity, as EC2 does when a region runs dry), and the
launcher's view of a fleet across both regions (a node boots wherever EC2 placed it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetd.demo import configs
from fleetd.demo.launcher import fleet_instances
from fleetd.policy.model import PoolId

HOME = "us-east-1"
OTHER = "us-west-2"
OTHER_BUCKET = "fleetd-demo-west"


@dataclass
class Move:
    job: str
    withdrawn_at: float  # spot capacity withdrawn from the job's region
    last_step_before: int
    durable_step: int | None = None
    moved_from: str | None = None
    moved_to: str | None = None
    copied_at: float | None = None  # region.json written: the checkpoint is in the new bucket
    objects: int | None = None
    resumed_at: float | None = None
    resumed_from: int | None = None
    resumed_in: str | None = None  # the zone of the node that trained after the move

    @property
    def steps_lost(self) -> int | None:
        if self.resumed_from is None:
            return None
        return max(0, self.last_step_before - self.resumed_from)

    def as_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "from": self.moved_from,
            "to": self.moved_to,
            "last_step_before": self.last_step_before,
            "durable_step": self.durable_step,
            "resumed_from": self.resumed_from,
            "resumed_in_zone": self.resumed_in,
            "steps_lost": self.steps_lost,
            "objects_copied": self.objects,
            "copied_after_s": round(self.copied_at - self.withdrawn_at, 1) if self.copied_at else None,
            "training_again_after_s": round(self.resumed_at - self.withdrawn_at, 1) if self.resumed_at else None,
        }


async def other_region(session: Any, aws: Mapping[str, Any]) -> str:
    """The second region's bucket; the AMI id there (moto lists its images per region)."""
    west = {**aws, "region_name": OTHER}
    async with session.create_client("s3", **west) as s3:
        await s3.create_bucket(Bucket=OTHER_BUCKET, CreateBucketConfiguration={"LocationConstraint": OTHER})
    async with session.create_client("ec2", **west) as ec2:
        return str((await ec2.describe_images(Owners=["amazon"]))["Images"][0]["ImageId"])


def region_overrides(ami_west: str) -> dict[str, dict[str, object]]:
    """What the moving job's config adds: the other region it may run in."""
    return {"team": {"member": True, "regions": [{"region": OTHER, "bucket": OTHER_BUCKET, "ami_id": ami_west}]}}


def declare_work(job_file: Path, total_steps: int = 10_000_000, steps_per_s: float = 5.0) -> None:
    """The moving job's work in its job file (total steps and pace): without it no move can be
    shown to pay (fleetd/team/inputs.py remaining_gpu_hours). Top-level keys go before the tables."""
    job_file.write_text(f"total_steps = {total_steps}\nsteps_per_s = {steps_per_s}\n" + job_file.read_text())


def dearer_elsewhere(proxy: Any, factor: float = 1.2) -> None:
    """Spot in the other region at ``factor`` x the home region's (the team simulator's assumption
    too): every job is placed at home first, and a move has a price to pay for itself."""
    fake = proxy.spot_prices
    for itype in configs.DEMO_TYPES:
        home = max(p for z in configs.DEMO_ZONES if (p := fake.price(PoolId(itype, z))) is not None)
        for zone in ("a", "b", "c", "d"):
            fake.set(PoolId(itype, f"{OTHER}{zone}"), round(factor * home, 4))


def withdraw_spot(proxy: Any, region_zones: tuple[str, ...] = configs.DEMO_ZONES) -> None:
    """Every spot pool the demo buys in ``region_zones`` fails from now on."""
    for itype in configs.DEMO_TYPES:
        for zone in region_zones:
            proxy.fail("CreateFleet", "InsufficientInstanceCapacity", pool=PoolId(itype, zone), times=None)


class TwoRegions:
    """A fleet's instances in both regions, and who to ask about each."""

    def __init__(self, east: Any, west: Any) -> None:
        self.clients = {HOME: east, OTHER: west}
        self._where: dict[str, Any] = {}

    async def instances(self, fleet: str) -> list[Mapping[str, Any]]:
        out: list[Mapping[str, Any]] = []
        for client in self.clients.values():
            found = await fleet_instances(client, fleet)
            self._where.update({i["InstanceId"]: client for i in found})
            out += found
        return out

    def client_of(self, inst: Mapping[str, Any]) -> Any:
        zone = str(inst.get("Placement", {}).get("AvailabilityZone", HOME))
        return self.clients[OTHER] if zone.startswith(OTHER) else self.clients[HOME]

    async def terminate(self, iid: str) -> None:
        await self._where.get(iid, self.clients[HOME]).terminate_instances(InstanceIds=[iid])


def region_record(state_dir: Path) -> Any:
    from fleetd.team.region_file import read_region

    return read_region(state_dir)
