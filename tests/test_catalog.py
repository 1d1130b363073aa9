"""The bundled GPU catalog: complete for NVIDIA GPU types, commercial regions only, dated and
sourced, and consistent with prices we know and with the demo book."""

from __future__ import annotations

import json

import pytest

from fleetd.adapters.catalog import CATALOG_PATH, CatalogError, bundled_catalog, parse_catalog
from fleetd.adapters.pricing import FilePriceBook

# us-east-1: Karpenter's generated Price List snapshot (Apache-2.0; the catalog's licensed source).
KNOWN = {
    ("g4dn.xlarge", "us-east-1"): 0.526,
    ("g5.xlarge", "us-east-1"): 1.006,
    ("g6.xlarge", "us-east-1"): 0.8048,
    ("g6e.xlarge", "us-east-1"): 1.861,
    ("p3.2xlarge", "us-east-1"): 3.06,
    ("p4d.24xlarge", "us-east-1"): 21.957642,
    ("p4de.24xlarge", "us-east-1"): 27.44705,
    ("p5.48xlarge", "us-east-1"): 55.04,
    ("p5en.48xlarge", "us-east-1"): 63.296,
}
# Other regions: numbers from a table with no license (and AWS's pricing page, from memory).
UNVERIFIED = {
    ("g4dn.xlarge", "eu-west-1"): 0.587,
    ("p3.2xlarge", "eu-west-1"): 3.305,
    ("g4dn.xlarge", "us-west-1"): 0.631,
}


def test_catalog_is_dated_sourced_and_loads() -> None:
    c = bundled_catalog()
    assert c.prices_as_of and c.generated_at
    assert any("karpenter" in s["from"] for s in c.sources) and all(s.get("license") for s in c.sources)
    assert json.loads(CATALOG_PATH.read_text())["regenerate"].startswith("python -m fleetd.tools.gpu_catalog")


@pytest.mark.parametrize("key, usd", sorted(KNOWN.items()))
def test_known_prices(key, usd) -> None:
    assert bundled_catalog().on_demand(*key) == pytest.approx(usd)
    assert bundled_catalog().listed_on_demand(*key) == (pytest.approx(usd), True)


@pytest.mark.parametrize("key, usd", sorted(UNVERIFIED.items()))
def test_a_price_without_a_licensed_source_is_listed_but_unknown_to_the_daemon(key, usd) -> None:
    c = bundled_catalog()
    assert c.on_demand(*key) is None
    assert c.listed_on_demand(*key) == (pytest.approx(usd), False)


def test_price_provenance_names_a_source_and_license_for_every_licensed_price() -> None:
    c = bundled_catalog()
    licensed = {r for spec in c.types.values() for r in spec.licensed_regions}
    assert licensed == {"us-east-1"}  # Karpenter's aws-partition snapshot covers us-east-1 only
    for region in licensed:
        assert "Apache-2.0" in (c.licensed_source(region) or "")
    assert c.licensed_source("eu-west-1") is None
    # g7e is newer than the snapshot: its us-east-1 price is unverified too.
    assert c.on_demand("g7e.2xlarge", "us-east-1") is None and c.listed_on_demand("g7e.2xlarge", "us-east-1")[0]


def test_every_nvidia_family_fleetd_trains_on_is_there() -> None:
    families = {t.split(".")[0] for t in bundled_catalog().types}
    assert {
        "p5",
        "p5en",
        "p4d",
        "p4de",
        "p3",
        "p3dn",
        "p2",
        "g6",
        "g6e",
        "g5",
        "g5g",
        "g4dn",
        "g3",
        "g3s",
        "gr6",
        "p6-b200",
    } <= families
    assert not families & {"g4ad", "inf1", "inf2", "trn1", "dl1"}  # not CUDA


def test_throughput_is_relative_to_a10g_and_every_number_has_a_basis() -> None:
    c = bundled_catalog()
    assert c.models["A10G"].relative_throughput == 1.0
    assert all(m.basis for m in c.models.values())
    t = {name: m.relative_throughput for name, m in c.models.items()}
    assert t["K80"] < t["T4"] < t["L4"] < t["A10G"] < t["V100"] < t["L40S"] < t["A100-40G"] < t["H100"] < t["B200"]
    assert c.throughput_of("p4de.24xlarge") == t["A100-80G"] and c.throughput_of("p4d.24xlarge") == t["A100-40G"]
    assert c.throughput_of("unknown.type", "A10G") == 1.0 and c.throughput_of("unknown.type", "T4g") == t["T4G"]
    assert c.throughput_of("unknown.type", "Z9000") is None


def test_regions_are_commercial_only() -> None:
    regions = bundled_catalog().regions()
    assert "us-east-1" in regions and "eu-west-1" in regions
    assert not any(r.startswith(("us-gov", "cn-")) for r in regions)


def test_demo_book_agrees_with_the_catalog() -> None:
    book, c = FilePriceBook.demo(), bundled_catalog()
    for pool in book.pools:
        spec = c.spec(pool.instance_type)
        assert book.price_at(pool, 0.0).on_demand == c.on_demand(pool.instance_type, "us-east-1")
        assert book.hardware(pool.instance_type).gpu_model == spec.gpu_model


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d["instance_types"]["g5.xlarge"]["on_demand"].update({"us-west-2-lax-1": 1.0}), "commercial"),
        (lambda d: d["instance_types"]["g5.xlarge"]["on_demand"].update({"us-east-1": -1}), "positive"),
        (lambda d: d["instance_types"]["g5.xlarge"].update({"gpu_model": "Z9000"}), "unknown gpu_model"),
        (lambda d: d["instance_types"]["g5.xlarge"].update({"on_demand_licensed": ["eu-north-9"]}), "without a price"),
        (lambda d: d.update({"schema_version": 99}), "schema_version"),
    ],
)
def test_malformed_catalog_is_rejected(mutate, match) -> None:
    doc = json.loads(CATALOG_PATH.read_text())
    mutate(doc)
    with pytest.raises(CatalogError, match=match):
        parse_catalog(doc)
