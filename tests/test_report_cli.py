"""`fleetd report [--json]` through the real command line, on a ledger DB populated here."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fleetd.reconcile.ledger_store import LedgerStore
from tests.test_ledger import FIRST_HALF, GOODPUT, SECOND_HALF, T0

FLEETD = Path(sys.executable).parent / "fleetd"


@pytest.fixture
def config_with_ledger(tmp_path: Path) -> Path:
    state = tmp_path / "state"

    async def populate() -> None:
        store = await LedgerStore.open(state / "fleetd.db")
        await store.append(*FIRST_HALF, *SECOND_HALF, *GOODPUT)
        await store.close()

    asyncio.run(populate())
    cfg = tmp_path / "fleetd.toml"
    cfg.write_text(f'[fleet]\nstate_dir = "{state}"\n')
    return cfg


def _report(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETD_")}
    return subprocess.run([str(FLEETD), "report", *args], capture_output=True, text=True, timeout=60, env=env)


def test_json_report_has_the_promised_fields(config_with_ledger: Path) -> None:
    proc = _report("--config", str(config_with_ledger), "--json", "--at", str(T0 + 10_000))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["spend_usd"] == pytest.approx(0.80)
    assert data["on_demand_equivalent_usd"] == pytest.approx(1.27)
    assert data["savings_pct"] == pytest.approx(100 * (1 - 0.80 / 1.27), abs=1e-3)
    assert data["useful_steps"] == 1600
    assert data["steps_lost"] == 20
    assert data["usd_per_1k_steps"] == pytest.approx(0.50)
    assert data["spend_by_market"] == pytest.approx({"on-demand": 0.02, "spot": 0.78})
    assert data["recovery_s"] == 4.5 and data["idle_gpu_s"] == 30.0


def test_table_report_for_people(config_with_ledger: Path) -> None:
    proc = _report("--config", str(config_with_ledger), "--at", str(T0 + 10_000))
    assert proc.returncode == 0, proc.stderr
    rows = dict(
        re.split(r"\s{2,}", line.strip(), maxsplit=1)
        for line in proc.stdout.splitlines()
        if re.search(r"\S\s{2,}\S", line)
    )
    assert rows["spend"] == "$0.80"
    assert rows["on-demand equivalent"] == "$1.27"
    assert rows["savings vs on-demand"] == "37.0 %"
    assert rows["useful steps"] == "1,600"
    assert rows["steps lost"] == "20"
    assert rows["USD per 1,000 useful steps"] == "$0.50"
    assert rows["spend in g5.xlarge@us-east-1b"] == "$0.02"


def test_missing_ledger_is_a_clear_error(tmp_path: Path) -> None:
    cfg = tmp_path / "fleetd.toml"
    cfg.write_text(f'[fleet]\nstate_dir = "{tmp_path / "nothing-here"}"\n')
    proc = _report("--config", str(cfg), "--json")
    assert proc.returncode == 1
    assert "no ledger at" in proc.stderr and proc.stdout == ""


def test_bad_config_is_reported_field_by_field(tmp_path: Path) -> None:
    cfg = tmp_path / "fleetd.toml"
    cfg.write_text("[fleet]\nstate_dirr = 3\n")
    proc = _report("--config", str(cfg))
    assert proc.returncode == 2
    assert "fleet.state_dirr" in proc.stderr


def test_plot_draws_a_png_and_the_report_lists_scaling_decisions(tmp_path: Path) -> None:
    from fleetd.policy.ledger import TargetChanged

    state = tmp_path / "state"

    async def populate() -> None:
        store = await LedgerStore.open(state / "fleetd.db")
        await store.append(
            *FIRST_HALF, *SECOND_HALF, *GOODPUT, TargetChanged(T0 + 2600, 1, 2, "scale up 1->2: exploring")
        )
        await store.close()

    asyncio.run(populate())
    cfg = tmp_path / "fleetd.toml"
    cfg.write_text(f'[fleet]\nstate_dir = "{state}"\n')
    png = tmp_path / "run.png"
    proc = _report("--config", str(cfg), "--at", str(T0 + 10_000), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "1 -> 2: scale up 1->2: exploring" in proc.stdout
    data = json.loads(_report("--config", str(cfg), "--json", "--at", str(T0 + 10_000)).stdout)
    assert data["scaling_decisions"] == [{"at": T0 + 2600, "from": 1, "to": 2, "reason": "scale up 1->2: exploring"}]


def test_the_report_states_how_the_job_ended(config_with_ledger: Path) -> None:
    from fleetd.job_record import JobView, write_job
    from fleetd.policy.job_state import JobState

    proc = _report("--config", str(config_with_ledger), "--json", "--at", str(T0 + 10_000))
    assert json.loads(proc.stdout)["job"] is None  # no job file: unknown, not a guess
    write_job(
        config_with_ledger.parent / "state",
        JobView(state=JobState.SUCCEEDED, reason="the run command exited 0", ended_at=T0 + 900, final_step=1600),
    )
    data = json.loads(_report("--config", str(config_with_ledger), "--json", "--at", str(T0 + 10_000)).stdout)
    assert data["job"]["state"] == "succeeded" and data["job"]["final_step"] == 1600
    table = _report("--config", str(config_with_ledger), "--at", str(T0 + 10_000)).stdout
    assert "succeeded (the run command exited 0)" in table


def test_job_list_gives_state_step_spend_and_cost_per_useful_step(config_with_ledger: Path) -> None:
    from fleetd.job_record import JobView, write_job
    from fleetd.policy.job_state import JobState

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETD_")}

    def job_list(*args: str) -> subprocess.CompletedProcess:
        cmd = [str(FLEETD), "job", "list", "--config", str(config_with_ledger), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)

    # Before the daemon wrote the job's record: the state is unknown, never guessed.
    proc = job_list("--json")
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)
    assert row["state"] == "unknown" and row["spend_usd"] == pytest.approx(0.80)
    assert row["usd_per_1k_steps"] == pytest.approx(0.50) and row["step"] is not None
    state = config_with_ledger.parent / "state"
    write_job(state, JobView(state=JobState.SUCCEEDED, since=T0, final_step=1620, code_digest="cd" * 32))
    (row,) = json.loads(job_list("--json").stdout)
    assert (row["state"], row["step"], row["code_digest"]) == ("succeeded", 1620, "cd" * 32)
    table = job_list().stdout.splitlines()
    assert table[0].split() == ["JOB", "STATE", "STEP", "SPEND", "$/1K", "STEPS", "VERSION"]
    assert table[1].split()[1:] == ["succeeded", "1,620", "$0.80", "$0.5000", "cd" * 6]


def test_job_list_without_a_ledger_says_so(tmp_path: Path) -> None:
    cfg = tmp_path / "fleetd.toml"
    cfg.write_text(f'[fleet]\nstate_dir = "{tmp_path / "none"}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETD_")}
    proc = subprocess.run(
        [str(FLEETD), "job", "list", "--config", str(cfg)], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 1 and "no ledger at" in proc.stderr
