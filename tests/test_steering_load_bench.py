"""bench/steering_load.py's short mode (CI): fleetd's steering with 100 simulated members on the
real TCPStore; every leave must end in a complete round without the leaver. Timings are the
bench's to report, never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_short_steering_run_completes_a_round_after_every_leave() -> None:
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "steering_load.py"), "--members", "100", "--leaves", "2", "--procs", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    for key in (
        "members",
        "leave_to_round_s",
        "store_ops_per_pass_p50",
        "steer_pass_p99_s",
        "state_blob_bytes",
        "loadavg_start",
        "loadavg_end",
    ):
        assert key in r, key
    assert r["members"] == 100 and r["rounds_completed"] == 2, r
    assert all(x is not None for x in r["leave_to_round_each_s"]), r
    # Steady passes read a handful of keys, not one per member (the key-count check).
    assert r["store_ops_per_pass_p50"] < 100, r
