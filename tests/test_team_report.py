"""`fleetd team report`: each job's spend and training from its own ledger (the numbers
`fleetd report` gives it), the team's totals against its budget and the moves it made; a job whose
ledger cannot be read makes the team's spend a lower bound and its $ per 1k steps unknown."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleetd.commands.team_report import render_team_report, team_report
from fleetd.reconcile.ledger_store import LedgerStore
from fleetd.team.config import load_team
from fleetd.team.region_file import RegionRecord, write_region
from tests.test_ledger import FIRST_HALF, GOODPUT, SECOND_HALF, T0

FLEETD = Path(sys.executable).parent / "fleetd"


def _job(tmp_path: Path, name: str, events: list) -> None:
    state = tmp_path / name

    async def populate() -> None:
        store = await LedgerStore.open(state / "fleetd.db")
        await store.append(*events)
        await store.close()

    if events:
        asyncio.run(populate())
    (tmp_path / f"{name}.toml").write_text(
        f'[fleet]\nname = "{name}"\nstate_dir = "{state}"\n[aws]\nregion = "us-east-1"\n'
        '[team]\nmember = true\n[[team.regions]]\nregion = "us-west-2"\nbucket = "ckpt-west"\n'
    )


def _team(tmp_path: Path, names: list[str]) -> Path:
    path = tmp_path / "team.toml"
    jobs = "".join(
        f'[[jobs]]\nname = "{n}"\nconfig = "{tmp_path / n}.toml"\npriority = {i}\n' for i, n in enumerate(names)
    )
    path.write_text(f'[team]\nname = "lab"\ntotal_usd = 10.0\nmax_usd_per_hour = 5.0\n{jobs}')
    return path


def test_the_team_report_adds_up_its_jobs_ledgers_and_names_the_moves(tmp_path: Path) -> None:
    _job(tmp_path, "prod", [*FIRST_HALF, *SECOND_HALF, *GOODPUT])
    _job(tmp_path, "sweep", [*FIRST_HALF, *GOODPUT[:1]])
    (tmp_path / "sweep").mkdir(exist_ok=True)
    write_region(
        tmp_path / "sweep",
        RegionRecord(
            job="sweep", region="us-west-2", moved_from="us-east-1", moved_at=T0, objects=5, bytes=9, copy_s=0.2
        ),
    )
    cfg = load_team(_team(tmp_path, ["prod", "sweep"]))
    r = team_report(cfg, T0 + 10_000)
    jobs = {j["name"]: j for j in r["jobs"]}
    assert jobs["prod"]["spend_usd"] == pytest.approx(0.80) and jobs["prod"]["useful_steps"] == 1600
    assert jobs["sweep"]["region"] == "us-west-2" and jobs["prod"]["region"] == "us-east-1"
    assert r["team_spend_usd"] == pytest.approx(jobs["prod"]["spend_usd"] + jobs["sweep"]["spend_usd"])
    assert r["team_useful_steps"] == 1600 + 520 and r["team_steps_lost"] == 20
    assert r["team_usd_per_1k_steps"] == pytest.approx(1000 * r["team_spend_usd"] / 2120)
    assert not r["spend_is_lower_bound"] and r["team_budget_usd"] == 10.0
    assert [(m["job"], m["moved_from"], m["region"]) for m in r["region_moves"]] == [
        ("sweep", "us-east-1", "us-west-2")
    ]
    assert "moved: sweep us-east-1 -> us-west-2 (5 objects copied)" in render_team_report(r)


def test_a_job_with_no_ledger_makes_the_team_spend_a_lower_bound(tmp_path: Path) -> None:
    _job(tmp_path, "prod", [*FIRST_HALF, *SECOND_HALF, *GOODPUT])
    _job(tmp_path, "new", [])
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETD_")}
    proc = subprocess.run(
        [str(FLEETD), "team", "report", "--json", "--config", str(_team(tmp_path, ["prod", "new"]))],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    jobs = {j["name"]: j for j in r["jobs"]}
    assert "no ledger at" in jobs["new"]["error"]
    assert r["spend_is_lower_bound"] and r["team_usd_per_1k_steps"] is None
    assert r["team_spend_usd"] == pytest.approx(jobs["prod"]["spend_usd"])
