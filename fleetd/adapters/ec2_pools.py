"""Pools from config: which (instance type, zone) pairs the fleet may use, from
DescribeInstanceTypes, DescribeSubnets and DescribeAvailabilityZones."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetd.adapters.aws_errors import PermanentAwsError, aws_call
from fleetd.adapters.pricing import Hardware
from fleetd.config import GpuRequirements
from fleetd.policy.model import PoolId


@dataclass(frozen=True, slots=True)
class ResolvedPools:
    pools: tuple[PoolId, ...]
    hardware: dict[str, Hardware] = field(default_factory=dict)


def gpu_hardware(item: Mapping[str, Any]) -> Hardware:
    gpus = (item.get("GpuInfo") or {}).get("Gpus") or []
    count = sum(int(g.get("Count", 0)) for g in gpus)
    model = gpus[0].get("Name", "") if gpus else ""
    mem_mib = gpus[0].get("MemoryInfo", {}).get("SizeInMiB", 0) if gpus else 0
    return Hardware(gpus=count, gpu_model=model, gpu_memory_gib=round(mem_mib / 1024, 1))


def matches(hw: Hardware, req: GpuRequirements) -> bool:
    if hw.gpus != req.count:
        return False
    if req.models and hw.gpu_model.lower() not in {m.lower() for m in req.models}:
        return False
    return hw.gpu_memory_gib + 1e-9 >= req.min_memory_gib


async def resolve_pools(
    client: Any,
    *,
    instance_types: Sequence[str],
    gpu: GpuRequirements | None,
    zones: Sequence[str],
) -> ResolvedPools:
    """Pools = (type, zone) for the configured types, or for every type whose GPUs meet ``gpu``
    (DescribeInstanceTypes), in each configured zone."""
    if not zones:
        raise PermanentAwsError("ResolvePools", "NoZones", "capacity.zones must name at least one zone")
    params: dict[str, Any] = {}
    if instance_types:
        params["InstanceTypes"] = list(instance_types)
    else:
        # NVIDIA GPU types live in the g and p families; the filter keeps the answer small (the
        # full list is over a thousand types), and each type's GpuInfo decides the rest.
        params["Filters"] = [{"Name": "instance-type", "Values": ["g*", "p*"]}]
    hardware: dict[str, Hardware] = {}
    async with aws_call("DescribeInstanceTypes"):
        async for page in client.get_paginator("describe_instance_types").paginate(**params):
            for item in page.get("InstanceTypes", []):
                hw = gpu_hardware(item)
                if instance_types or (gpu is not None and matches(hw, gpu)):
                    hardware[item["InstanceType"]] = hw
    types = sorted(hardware)
    if not types:
        raise PermanentAwsError("ResolvePools", "NoMatchingTypes", f"no instance type matches {gpu}")
    return ResolvedPools(tuple(PoolId(t, z) for t in types for z in zones), hardware)


async def subnets_by_zone(client: Any, subnet_ids: Sequence[str]) -> dict[str, str]:
    """zone -> subnet for the configured subnets (the first subnet per zone wins)."""
    if not subnet_ids:
        return {}
    async with aws_call("DescribeSubnets"):
        resp = await client.describe_subnets(SubnetIds=list(subnet_ids))
    out: dict[str, str] = {}
    for s in sorted(resp.get("Subnets", []), key=lambda s: subnet_ids.index(s["SubnetId"])):
        out.setdefault(s["AvailabilityZone"], s["SubnetId"])
    return out


async def default_zones(client: Any, subnet_ids: Sequence[str]) -> tuple[str, ...]:
    """No zones configured: the zones of the configured subnets, else every available zone of
    the region (more pools means more places to find spot capacity)."""
    if subnet_ids:
        return tuple(sorted(await subnets_by_zone(client, subnet_ids)))
    async with aws_call("DescribeAvailabilityZones"):
        resp = await client.describe_availability_zones(
            Filters=[{"Name": "state", "Values": ["available"]}, {"Name": "zone-type", "Values": ["availability-zone"]}]
        )
    return tuple(sorted(z["ZoneName"] for z in resp.get("AvailabilityZones", [])))
