"""The bundled GPU catalog: every NVIDIA GPU instance type EC2 sells, its hardware, its on-demand
Linux price per commercial region, and a relative training throughput per GPU model.

``fleetd/data/gpu_catalog.json`` is generated (``python -m fleetd.tools.gpu_catalog``; its
``sources`` say from what and when). It is the price fallback, the hardware facts
DescribeInstanceTypes does not give, and what ``fleetd pools`` lists offline; only licensed prices
count as prices (fleetd/data/README.md). (docs/DESIGN.md "Prices")
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

CATALOG_PATH = Path(__file__).resolve().parent.parent / "data" / "gpu_catalog.json"
CATALOG_SCHEMA = 1
# A commercial region name: two letters, a direction, a number (us-east-1, ap-southeast-5).
# Local Zones (us-west-2-lax-1), GovCloud and China are outside fleetd's scope.
REGION_RE = re.compile(r"^[a-z]{2}-[a-z]+-\d+$")


class CatalogError(ValueError):
    """The catalog file is malformed (names the file and the entry)."""


@dataclass(frozen=True, slots=True)
class GpuModel:
    name: str
    memory_gib: float
    relative_throughput: float  # training throughput of one GPU relative to one A10G
    basis: str  # where the number comes from (approximate)
    torch_supported: bool = True
    note: str = ""


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    instance_type: str
    gpu_model: str
    gpus: float  # < 1 for fractional-GPU types (g6f, gr6f)
    gpu_memory_gib: float  # per GPU (or per fraction)
    vcpu: int
    memory_gib: float
    architecture: str
    on_demand: Mapping[str, float] = field(default_factory=dict)  # region -> USD/h (any source)
    note: str = ""
    # Regions whose on-demand price comes from (or was checked against) a licensed source.
    licensed_regions: frozenset[str] = frozenset()

    @property
    def whole_gpus(self) -> bool:
        return self.gpus >= 1 and float(self.gpus).is_integer()


@dataclass(frozen=True, slots=True)
class Catalog:
    generated_at: str
    prices_as_of: str
    sources: tuple[Mapping[str, str], ...]
    models: Mapping[str, GpuModel]
    types: Mapping[str, InstanceSpec]
    omitted: Mapping[str, str] = field(default_factory=dict)
    price_provenance: Mapping[str, Any] = field(default_factory=dict)

    # -- queries -------------------------------------------------------------------------------
    def spec(self, instance_type: str) -> InstanceSpec | None:
        return self.types.get(instance_type)

    def on_demand(self, instance_type: str, region: str) -> float | None:
        """The on-demand price the daemon may use offline: only one from a licensed source;
        None otherwise (unknown until the Price List API answers). A number copied from a table
        nobody may redistribute, and that nobody here checked, is no basis for a bid or a budget."""
        spec = self.types.get(instance_type)
        if spec is None or region not in spec.licensed_regions:
            return None
        return spec.on_demand.get(region)

    def listed_on_demand(self, instance_type: str, region: str) -> tuple[float | None, bool]:
        """(the static price, whether a licensed source backs it), for listings that show an
        unverified number as such, and for the test cloud, which stands in for AWS."""
        spec = self.types.get(instance_type)
        if spec is None:
            return None, False
        return spec.on_demand.get(region), region in spec.licensed_regions

    def licensed_source(self, region: str) -> str | None:
        """Where the licensed prices of ``region`` come from, with the license; None: none."""
        entry = self.price_provenance.get("licensed", {}).get(region)
        return f"{entry['source']} ({entry['license']})" if entry else None

    def types_in(self, region: str) -> tuple[str, ...]:
        """Instance types with an on-demand price in ``region``."""
        return tuple(sorted(t for t, s in self.types.items() if region in s.on_demand))

    def regions(self) -> tuple[str, ...]:
        return tuple(sorted({r for s in self.types.values() for r in s.on_demand}))

    def model_of(self, instance_type: str) -> GpuModel | None:
        spec = self.types.get(instance_type)
        return self.models.get(spec.gpu_model) if spec else None

    def throughput_of(self, instance_type: str, gpu_model: str = "") -> float | None:
        """Relative training throughput of one GPU of ``instance_type`` (one A10G = 1.0): by the
        catalog's entry for the type, else by a GPU model name as DescribeInstanceTypes spells it
        ("A10G", "T4g", "A100"); None when unknown."""
        model = self.model_of(instance_type)
        if model is None and gpu_model:
            by_upper = {k.upper(): m for k, m in self.models.items()}
            model = by_upper.get(normalise_model(gpu_model))
        return model.relative_throughput if model else None

    @property
    def label(self) -> str:
        return f"bundled GPU catalog (prices as of {self.prices_as_of}, generated {self.generated_at})"


# DescribeInstanceTypes' GPU names that differ from the catalog's keys. "A100" alone is the
# 40 GB part (p4d); p4de is found by its instance type first.
_ALIASES = {"A100": "A100-40G", "RTX PRO 6000 BLACKWELL": "RTX PRO 6000"}


def normalise_model(name: str) -> str:
    upper = name.strip().upper()
    return _ALIASES.get(upper, upper)


def parse_catalog(doc: Mapping[str, Any], source: str = "catalog") -> Catalog:
    if not isinstance(doc, Mapping) or doc.get("schema_version") != CATALOG_SCHEMA:
        raise CatalogError(f"{source}: expected schema_version {CATALOG_SCHEMA}")
    try:
        models = {
            name: GpuModel(
                name=name,
                memory_gib=float(m["memory_gib"]),
                relative_throughput=_positive(m["relative_throughput"]),
                basis=str(m.get("basis", "")),
                torch_supported=bool(m.get("torch_supported", True)),
                note=str(m.get("note", "")),
            )
            for name, m in doc["gpu_models"].items()
        }
        types = {}
        for itype, e in doc["instance_types"].items():
            if e["gpu_model"] not in models:
                raise CatalogError(f"{source}: {itype}: unknown gpu_model {e['gpu_model']!r}")
            prices = {}
            for region, usd in e.get("on_demand", {}).items():
                if not REGION_RE.match(region):
                    raise CatalogError(f"{source}: {itype}: {region!r} is not a commercial region")
                prices[region] = _positive(usd)
            types[itype] = InstanceSpec(
                instance_type=itype,
                gpu_model=e["gpu_model"],
                gpus=_count(e["gpus"]),
                gpu_memory_gib=float(e["gpu_memory_gib"]),
                vcpu=int(e["vcpu"]),
                memory_gib=float(e["memory_gib"]),
                architecture=str(e.get("architecture", "x86_64")),
                on_demand=prices,
                note=str(e.get("note", "")),
                licensed_regions=_licensed(itype, e.get("on_demand_licensed", ()), prices, source),
            )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CatalogError):
            raise
        raise CatalogError(f"{source}: {exc!r}") from None
    return Catalog(
        generated_at=str(doc.get("generated_at", "")),
        prices_as_of=str(doc.get("prices_as_of", "")),
        sources=tuple(doc.get("sources", ())),
        models=models,
        types=types,
        omitted=dict(doc.get("omitted", {})),
        price_provenance=dict(doc.get("price_provenance", {})),
    )


def _licensed(itype: str, regions: Any, prices: Mapping[str, float], source: str) -> frozenset[str]:
    if not isinstance(regions, (list, tuple)):
        raise CatalogError(f"{source}: {itype}: on_demand_licensed must be a list of regions")
    missing = [r for r in regions if r not in prices]
    if missing:
        raise CatalogError(f"{source}: {itype}: on_demand_licensed names regions without a price: {missing}")
    return frozenset(regions)


def _positive(value: Any) -> float:
    v = float(value)
    if not (v > 0 and math.isfinite(v)):  # also rejects NaN and infinity
        raise ValueError(f"expected a positive number, got {value!r}")
    return v


def _count(value: Any) -> float:
    """A GPU count: an int when whole (8, not 8.0), a fraction for g6f-style shares."""
    v = _positive(value)
    return int(v) if v.is_integer() else v


def load_catalog(path: Path = CATALOG_PATH) -> Catalog:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CatalogError(f"{path}: {exc}") from None
    return parse_catalog(doc, str(path))


@lru_cache(maxsize=1)
def bundled_catalog() -> Catalog:
    """The catalog shipped with fleetd (read once per process)."""
    return load_catalog(CATALOG_PATH)
