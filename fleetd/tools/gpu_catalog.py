"""Regenerate fleetd/data/gpu_catalog.json from AWS: ``python -m fleetd.tools.gpu_catalog --out F``.

- hardware from ``ec2:DescribeInstanceTypes`` in every enabled commercial region (NVIDIA GPUs only:
  fleetd trains CUDA PyTorch; AMD, Gaudi, Inferentia and Trainium types are left out);
- on-demand Linux prices from ``pricing:GetProducts`` (ServiceCode AmazonEC2, TERM_MATCH on
  instanceType, operatingSystem=Linux, tenancy=Shared, preInstalledSw=NA, capacitystatus=Used),
  one paginated query per instance type covering every region;
- ``gpu_models`` (the relative throughput per GPU model and its basis) carried over from the
  existing file: AWS publishes no such number. A GPU model it does not know stops the run.

Needs credentials allowed ec2:DescribeRegions, ec2:DescribeInstanceTypes and pricing:GetProducts.
A one-off offline tool, so it uses botocore's synchronous client.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fleetd.adapters.catalog import CATALOG_PATH, REGION_RE, parse_catalog
from fleetd.adapters.price_list import FIXED_FILTERS, SERVICE_CODE, PriceListEntryError, parse_entry


def model_key(name: str, memory_gib: float) -> str:
    """DescribeInstanceTypes' GPU name and memory -> the catalog's GPU model key."""
    upper = name.strip().upper()
    if upper == "A100":
        return "A100-80G" if memory_gib >= 60 else "A100-40G"
    if upper == "V100" and memory_gib >= 30:
        return "V100-32G"
    if upper.startswith("RTX PRO 6000"):
        return "RTX PRO 6000"
    return upper


def hardware_entry(item: Mapping[str, Any]) -> dict[str, Any] | None:
    """One DescribeInstanceTypes item -> the catalog's hardware fields; None without NVIDIA GPUs."""
    gpus = [g for g in (item.get("GpuInfo") or {}).get("Gpus", []) if g.get("Manufacturer") == "NVIDIA"]
    if not gpus:
        return None
    mem_gib = round(gpus[0].get("MemoryInfo", {}).get("SizeInMiB", 0) / 1024, 1)
    archs = (item.get("ProcessorInfo") or {}).get("SupportedArchitectures") or ["x86_64"]
    return {
        "gpu_model": model_key(gpus[0].get("Name", ""), mem_gib),
        "gpus": sum(int(g.get("Count", 0)) for g in gpus),
        "gpu_memory_gib": mem_gib,
        "vcpu": int((item.get("VCpuInfo") or {}).get("DefaultVCpus", 0)),
        "memory_gib": round((item.get("MemoryInfo") or {}).get("SizeInMiB", 0) / 1024, 1),
        "architecture": "arm64" if "arm64" in archs else "x86_64",
        "on_demand": {},
    }


def build_catalog(
    described: Mapping[str, Mapping[str, Any]],
    price_items: Iterable[str | Mapping[str, Any]],
    previous: Mapping[str, Any],
    today: dt.date,
) -> dict[str, Any]:
    """The catalog document from DescribeInstanceTypes items (type -> item) and GetProducts
    PriceList items; ``previous``: the current catalog (for gpu_models)."""
    types: dict[str, dict[str, Any]] = {}
    for itype, item in described.items():
        entry = hardware_entry(item)
        if entry is not None:
            types[itype] = entry
    rejected = 0
    for raw in price_items:
        try:
            e = parse_entry(raw)
        except PriceListEntryError:
            rejected += 1
            continue
        if e.instance_type in types and REGION_RE.match(e.region) and not e.region.startswith(("us-gov", "cn-")):
            types[e.instance_type]["on_demand"][e.region] = round(e.usd_per_hour, 6)
    for entry in types.values():  # every price here is AWS's own answer: licensed by source
        entry["on_demand_licensed"] = sorted(entry["on_demand"])
    regions = sorted({r for entry in types.values() for r in entry["on_demand"]})
    models = dict(previous.get("gpu_models", {}))
    unknown = sorted({t["gpu_model"] for t in types.values()} - set(models))
    if unknown:
        raise SystemExit(f"add gpu_models entries (relative_throughput and its basis) for: {', '.join(unknown)}")
    doc = {
        "schema_version": 1,
        "generated_at": today.isoformat(),
        "prices_as_of": today.isoformat(),
        "currency": "USD",
        "price_unit": previous.get("price_unit", ""),
        "scope": previous.get("scope", ""),
        "sources": [
            {
                "what": "on-demand prices",
                "from": "AWS Price List API (pricing:GetProducts, AmazonEC2, "
                + ", ".join(f"{k}={v}" for k, v in FIXED_FILTERS.items())
                + ")",
                "license": "AWS public list prices",
            },
            {
                "what": "hardware",
                "from": "ec2:DescribeInstanceTypes in every enabled commercial region",
                "license": "facts",
            },
            *[s for s in previous.get("sources", []) if s.get("what") == "relative_throughput per GPU model"],
        ],
        "price_provenance": {
            "licensed": {
                r: {
                    "source": f"AWS Price List API (pricing:GetProducts), fetched {today.isoformat()}",
                    "license": "AWS's own public list prices, fetched by the operator",
                }
                for r in regions
            }
        },
        "regenerate": previous.get(
            "regenerate", "python -m fleetd.tools.gpu_catalog --out fleetd/data/gpu_catalog.json"
        ),
        "omitted": previous.get("omitted", {}),
        "rejected_price_entries": rejected,
        "gpu_models": models,
        "instance_types": dict(sorted(types.items())),
    }
    parse_catalog(doc, "generated catalog")  # the daemon must be able to read what we write
    return doc


def fetch(regions: list[str] | None) -> tuple[dict[str, Any], list[str]]:  # pragma: no cover - needs AWS
    import botocore.session

    session = botocore.session.get_session()
    if not regions:
        ec2: Any = session.create_client("ec2", region_name="us-east-1")  # botocore types no EC2 methods
        regions = sorted(r["RegionName"] for r in ec2.describe_regions()["Regions"])
    described: dict[str, Any] = {}
    for region in regions:
        ec2 = session.create_client("ec2", region_name=region)
        for page in ec2.get_paginator("describe_instance_types").paginate(
            Filters=[{"Name": "instance-type", "Values": ["g*", "p*"]}]
        ):
            for item in page["InstanceTypes"]:
                described.setdefault(item["InstanceType"], item)
    pricing = session.create_client("pricing", region_name="us-east-1")
    items: list[str] = []
    for itype in sorted(t for t, item in described.items() if hardware_entry(item)):
        filters = [{"Type": "TERM_MATCH", "Field": "instanceType", "Value": itype}] + [
            {"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in FIXED_FILTERS.items()
        ]
        for page in pricing.get_paginator("get_products").paginate(ServiceCode=SERVICE_CODE, Filters=filters):
            items += page["PriceList"]
    return described, items


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - needs AWS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=CATALOG_PATH)
    p.add_argument("--region", action="append", help="only these regions (default: every enabled one)")
    args = p.parse_args(argv)
    previous = json.loads(CATALOG_PATH.read_text())
    described, items = fetch(args.region)
    doc = build_catalog(described, items, previous, dt.date.today())
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{args.out}: {len(doc['instance_types'])} GPU instance types", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
