"""What ``fleetd pools`` lists: the pools a config would bid on in a region (or every GPU instance
type sold there), with hardware, prices, relative throughput, and why any pool is excluded.

Pure: the catalog, the config and any live prices come in, rows go out. The exclusion reasons for
a config's pools are the daemon's own (fleetd/reconcile/pool_offers.py): no whole GPU, no
on-demand price. Without a config, types fleetd could not train on out of the box are marked too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from fleetd.adapters.catalog import Catalog, InstanceSpec
from fleetd.policy.model import PoolId

AGENT_ARCH = "x86_64"  # deploy/packer builds the fleet-agent AMI for x86_64 only


@dataclass(frozen=True, slots=True)
class PoolListing:
    instance_type: str
    zone: str | None  # None: any zone of the region (no config, or no zones known offline)
    gpus: float | None
    gpu_model: str | None
    gpu_memory_gib: float | None
    vcpu: int | None
    memory_gib: float | None
    relative_throughput: float | None
    on_demand_usd_per_hour: float | None
    on_demand_source: str | None
    spot_usd_per_hour: float | None
    excluded: str | None = None
    # False: the price is the catalog's static number with no licensed source behind it; the
    # daemon treats it as unknown until the Price List API answers (fleetd/data/README.md).
    on_demand_verified: bool = True

    @property
    def pool(self) -> str:
        return f"{self.instance_type}@{self.zone}" if self.zone else self.instance_type

    @property
    def on_demand_usd_per_gpu_hour(self) -> float | None:
        if self.on_demand_usd_per_hour is None or not self.gpus:
            return None
        return round(self.on_demand_usd_per_hour / self.gpus, 4)

    def as_dict(self) -> dict[str, Any]:
        return {"pool": self.pool, **asdict(self), "on_demand_usd_per_gpu_hour": self.on_demand_usd_per_gpu_hour}


def types_for(catalog: Catalog, region: str, instance_types: Sequence[str] = (), gpu: Any = None) -> list[str]:
    """The config's explicit types; or the catalog's types in ``region`` meeting ``gpu``
    (count, models, min memory: the daemon's rule in fleetd/adapters/ec2.py); or, with neither,
    every type sold in the region."""
    if instance_types:
        return list(dict.fromkeys(instance_types))
    out = []
    for itype in catalog.types_in(region):
        spec = catalog.types[itype]
        if gpu is not None:
            if spec.gpus != gpu.count:
                continue
            if gpu.models and spec.gpu_model.lower() not in {m.lower() for m in gpu.models}:
                continue
            if spec.gpu_memory_gib + 1e-9 < gpu.min_memory_gib:
                continue
        out.append(itype)
    return out


def _general_reason(catalog: Catalog, spec: InstanceSpec) -> str | None:
    """Why fleetd would not pick this type when nobody asked for it."""
    if not spec.whole_gpus:
        return f"fractional GPU ({spec.gpus:g} of an {spec.gpu_model}): not a whole GPU for a training rank"
    model = catalog.models.get(spec.gpu_model)
    if model is not None and not model.torch_supported:
        return f"{spec.gpu_model}: {model.note}"
    if spec.architecture != AGENT_ARCH:
        return f"{spec.architecture} host: the fleet-agent AMI (deploy/packer) is {AGENT_ARCH}"
    return None


def list_pools(
    catalog: Catalog,
    region: str,
    *,
    instance_types: Sequence[str] = (),
    gpu: Any = None,
    zones: Sequence[str] = (),
    on_demand: Mapping[str, tuple[float, str]] | None = None,
    spot: Mapping[PoolId, float] | None = None,
    configured: bool = False,
) -> list[PoolListing]:
    """Rows per (type, zone) for ``zones`` in ``region`` (per type when no zone is known).
    ``on_demand``: live prices type -> (USD/h, source) that take precedence over the catalog;
    ``spot``: live spot prices per pool."""
    on_demand = on_demand or {}
    spot = spot or {}
    zones = [z for z in zones if z.startswith(region)] or [None]  # type: ignore[list-item]
    rows = []
    for itype in types_for(catalog, region, instance_types, gpu):
        spec = catalog.spec(itype)
        model = catalog.model_of(itype)
        verified = True
        od: float | None
        if itype in on_demand:
            od, od_source = on_demand[itype]
        else:
            od, verified = catalog.listed_on_demand(itype, region)
            od_source = None
            if od is not None:
                od_source = (
                    f"{catalog.label}: {catalog.licensed_source(region)}"
                    if verified
                    else f"{catalog.label}: UNVERIFIED (from a table with no license); the daemon treats it as "
                    "unknown until the Price List API answers"
                )
        reason = None
        if spec is None:
            reason = (
                "not in the bundled GPU catalog: no hardware facts or on-demand price known offline"
                " (the daemon asks DescribeInstanceTypes and the Price List API)"
            )
        elif od is None:
            asked = (
                "the Price List API and the bundled GPU catalog list" if on_demand else "the bundled GPU catalog lists"
            )
            reason = (
                f"no on-demand price for {itype} in {region} ({asked} none): not sold there, or only"
                " through Capacity Blocks"
            )
        elif not spec.whole_gpus or not configured:
            reason = _general_reason(catalog, spec)
        for zone in zones:
            rows.append(
                PoolListing(
                    instance_type=itype,
                    zone=zone,
                    gpus=spec.gpus if spec else None,
                    gpu_model=spec.gpu_model if spec else None,
                    gpu_memory_gib=spec.gpu_memory_gib if spec else None,
                    vcpu=spec.vcpu if spec else None,
                    memory_gib=spec.memory_gib if spec else None,
                    relative_throughput=model.relative_throughput if model else None,
                    on_demand_usd_per_hour=od,
                    on_demand_source=od_source,
                    spot_usd_per_hour=spot.get(PoolId(itype, zone)) if zone else None,
                    excluded=reason,
                    on_demand_verified=verified if od is not None else False,
                )
            )
    return rows
