"""Must-show (issue 19): the leader host's whole process tree (its `fleetd run` with the
steering, its `fleetd rendezvous` store) is SIGKILLed while real agents train with real torchrun
(CPU, gloo). The standby takes the lease, publishes its own store, every agent restarts torchrun
against it once, and training resumes. bench/leader_host_kill.py --quick, whose invariants are
asserted here; its timings are the bench's to report, never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[1]


def test_training_resumes_on_the_standbys_store_after_the_leader_host_is_killed(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "leader_host_kill.py"), "--quick", "--workdir", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=840,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)},
    )
    out = res.stdout.strip().splitlines()
    assert res.returncode == 0 and out, res.stdout[-3000:] + res.stderr[-4000:]
    s = json.loads(out[-1])
    detail = json.dumps(s)
    assert s["failure"] is None and s["trials"] == 1 and s["never_resumed"] == 0, detail
    [trial] = [json.loads(line) for line in out if line.startswith('{"trial"')]
    assert trial["processes_killed"] >= 2, "the store and the controller died together"
    assert trial["survivors"] == [], detail
    # The standby led, then published its own store, and the job trains on it from the step it
    # held when torchrun was moved (replicated state: the salvaged step; bound: 1 step).
    assert trial["takeover_s"] <= trial["published_s"] <= trial["training_again_s"], detail
    assert trial["resumed_from"] >= trial["step_at_kill"], detail
    assert s["steps_lost_max"] <= 1, detail
    # Each agent moved torchrun exactly once; nothing bought twice, nothing unknown to the state.
    assert s["agents"] == 2 and s["endpoint_restarts_not_one"] == 0, detail
    assert s["all_consistent"], detail
    assert s["instances_launched"] == 2 and s["create_fleet_calls"] == 1, detail
    assert s["stray_processes"] == 0, detail
