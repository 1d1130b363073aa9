"""fleetd.tools.gpu_catalog builds the catalog from DescribeInstanceTypes and GetProducts payloads
(canned here: the tool needs AWS), keeping gpu_models and refusing unknown GPU models."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from fleetd.adapters.catalog import CATALOG_PATH, parse_catalog
from fleetd.adapters.pricing_fake import product_entry
from fleetd.tools.gpu_catalog import build_catalog, model_key


def described(
    itype: str, name: str, count: int, mem_mib: int, vcpu: int, arch: str = "x86_64", maker: str = "NVIDIA"
) -> dict:
    return {
        "InstanceType": itype,
        "GpuInfo": {
            "Gpus": [{"Name": name, "Manufacturer": maker, "Count": count, "MemoryInfo": {"SizeInMiB": mem_mib}}]
        },
        "VCpuInfo": {"DefaultVCpus": vcpu},
        "MemoryInfo": {"SizeInMiB": vcpu * 4096},
        "ProcessorInfo": {"SupportedArchitectures": [arch]},
    }


def test_build_from_aws_payloads() -> None:
    previous = json.loads(CATALOG_PATH.read_text())
    items = [
        json.dumps(product_entry("g5.xlarge", "us-east-1", 1.006)),
        json.dumps(product_entry("g5.xlarge", "eu-west-1", 1.123)),
        json.dumps(product_entry("g5.xlarge", "us-gov-west-1", 1.2)),  # not commercial: dropped
        json.dumps(product_entry("p4de.24xlarge", "us-east-1", 27.44705)),
        json.dumps(product_entry("g4ad.xlarge", "us-east-1", 0.37853)),  # AMD: not in the catalog
        "{broken",
    ]
    doc = build_catalog(
        {
            "g5.xlarge": described("g5.xlarge", "A10G", 1, 24576, 4),
            "p4de.24xlarge": described("p4de.24xlarge", "A100", 8, 81920, 96),
            "g5g.xlarge": described("g5g.xlarge", "T4g", 1, 16384, 4, arch="arm64"),
            "g4ad.xlarge": described("g4ad.xlarge", "Radeon Pro V520", 1, 8192, 4, maker="AMD"),
        },
        items,
        previous,
        dt.date(2026, 12, 1),
    )
    cat = parse_catalog(doc)
    assert cat.generated_at == "2026-12-01" and doc["rejected_price_entries"] == 1
    assert set(cat.types) == {"g5.xlarge", "p4de.24xlarge", "g5g.xlarge"}
    assert dict(cat.types["g5.xlarge"].on_demand) == {"us-east-1": 1.006, "eu-west-1": 1.123}
    # Every price is the Price List API's own answer: licensed by source, in every region it priced.
    assert cat.on_demand("g5.xlarge", "eu-west-1") == 1.123
    assert "Price List API" in (cat.licensed_source("eu-west-1") or "")
    assert cat.types["p4de.24xlarge"].gpu_model == "A100-80G" and cat.types["p4de.24xlarge"].gpus == 8
    assert cat.types["g5g.xlarge"].architecture == "arm64" and cat.types["g5g.xlarge"].gpu_model == "T4G"
    assert cat.models["A10G"].relative_throughput == 1.0  # carried over


def test_unknown_gpu_model_stops_the_run() -> None:
    previous = json.loads(CATALOG_PATH.read_text())
    with pytest.raises(SystemExit, match="Z9000"):
        build_catalog({"z9.xlarge": described("z9.xlarge", "Z9000", 1, 1024, 4)}, [], previous, dt.date.today())


def test_model_keys() -> None:
    assert model_key("A100", 40.0) == "A100-40G" and model_key("V100", 32.0) == "V100-32G"
    assert model_key("L40S", 44.7) == "L40S" and model_key("T4g", 16) == "T4G"
