"""Which EC2 spot vCPU quota a GPU instance type draws from, and how much of it a fleet needs.
Pure. Codes from the Service Quotas console ("All <family> Spot Instance Requests")."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SPOT_QUOTAS: tuple[tuple[str, str, str], ...] = (
    # (quota code, quota name, instance type pattern)
    ("L-3819A6DF", "All G and VT Spot Instance Requests", r"^(g|vt)\d"),
    ("L-7212CCBC", "All P Spot Instance Requests", r"^p\d"),
    ("L-85EED4F7", "All DL Spot Instance Requests", r"^dl\d"),
    ("L-B5D1601B", "All Inf Spot Instance Requests", r"^inf\d"),
    ("L-88CF9481", "All F Spot Instance Requests", r"^f\d"),
    ("L-34B43A08", "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests", r"^[acdhimrtz]\d"),
    ("L-E3A00192", "All X Spot Instance Requests", r"^x\d"),
)


@dataclass(frozen=True, slots=True)
class QuotaNeed:
    code: str
    name: str
    vcpus: int  # max_nodes of the largest type of the family the config may buy
    types: tuple[str, ...]


def quota_of(instance_type: str) -> tuple[str, str] | None:
    for code, name, pattern in SPOT_QUOTAS:
        if re.match(pattern, instance_type):
            return code, name
    return None


def needs(types: Iterable[str], vcpus: Mapping[str, int], max_nodes: int) -> tuple[list[QuotaNeed], list[str]]:
    """(one need per quota, types with no known quota). The fleet may run max_nodes of any one
    type it may buy, so the need is max_nodes x the largest vCPU count among them."""
    by_code: dict[str, tuple[str, int, list[str]]] = {}
    unknown: list[str] = []
    for itype in types:
        found = quota_of(itype)
        if found is None or itype not in vcpus:
            unknown.append(itype)
            continue
        code, name = found
        _, most, members = by_code.get(code, (name, 0, []))
        by_code[code] = (name, max(most, vcpus[itype]), [*members, itype])
    out = [QuotaNeed(code, name, most * max_nodes, tuple(members)) for code, (name, most, members) in by_code.items()]
    return sorted(out, key=lambda q: q.code), unknown
