"""Where the spot traces are: the project's shared folder beside the checkout (as CI lays it out,
and as the issues quote the commands), else the copies bundled in fleetd/data/traces, which
tests/test_traces.py proves byte-identical to the upstream files by SHA-256."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "fleetd" / "data" / "traces"
_SHARED = REPO.parent / "shared" / "traces"

# SHA-256 of the upstream files (shared/traces/README.md names their origin).
UPSTREAM_SHA256 = {
    "p3-trace.csv": "0b7828fcd4637799590578287415d4d4bbb5e3cfef5fbaf23ca8e5b3ef6bdd68",
    "g4dn-trace.csv": "6a21d2003cfa16acfb65fb87b5521dd995c72f49a37900979eea177e853592eb",
    "aws_spot_advisor_gpu_snapshot_2025-06.csv": "913b862c600f2c0f880a691e82462613fdbc016e1ce7c1952f515ef3fa097ef7",
}


def trace_file(name: str) -> Path:
    sub = "" if name.startswith("aws_spot_advisor") else "oobleck-bamboo"
    shared = _SHARED / sub / name
    return shared if shared.is_file() else BUNDLED / name
