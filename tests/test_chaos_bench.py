"""The chaos bench's short version (CI): six faults of six kinds (seed 8: node, fleetd-run, ec2-throttle, worker, rendezvous, s3-drop) against the real demo stack; the
invariants must hold. Timings are the bench's to report, never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_quick_chaos_run_keeps_every_invariant(tmp_path: Path) -> None:
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "chaos.py"),
            "--faults",
            "6",
            "--quick",
            "--seed",
            "8",
            "--workdir",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    detail = json.dumps({k: v for k, v in summary.items() if k != "faults_detail"})
    assert summary["faults"] == 6, detail
    for key in (
        "orphans",
        "duplicates",
        "never_resumed",
        "over_budget",
        "stray_processes",
        "checkpoint_incomplete",
        "steps_over_bound",
    ):
        assert summary[key] == 0, f"{key}: {detail}\n{res.stderr[-3000:]}"
    assert len({f["kind"] for f in summary["faults_detail"]}) == 6, "six different kinds"
    assert all(
        k in summary["per_kind"][f["kind"]]
        for f in summary["faults_detail"]
        for k in ("recovery_s_p50", "recovery_s_p99", "steps_lost")
    )
