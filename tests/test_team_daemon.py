"""One team budget over two jobs, end to end against moto (issue 33): each job's reconcile loop is
the real one (``[team] member = true``), the team's arbiter reads their real status files and
writes their allotments, and EC2 holds what they buy. The team's money tightens: the lower job is
paused through the coordinated stop and its nodes are released while the higher one keeps its
own; room comes back: it resumes on fresh nodes."""

from __future__ import annotations

import json
import time
from pathlib import Path

from fleetd.config import load
from fleetd.policy.model import StopJob
from fleetd.reconcile.loop import PassReport, Reconciler
from fleetd.snapshot import build_snapshot, write_snapshot
from fleetd.team.allotment_file import read_allotment
from fleetd.team.arbiter import team_pass
from fleetd.team.config import TeamConfig, TeamGroup, TeamJobEntry
from fleetd.team.member import PAUSED_KEY
from tests.reconcile_support import ZONES, Cloud, FakeClock, built_reconciler


def job_config(cloud: Cloud, tmp_path: Path, name: str) -> Path:
    subnets = ", ".join(json.dumps(cloud.subnets[z]) for z in ZONES)
    path = tmp_path / f"{name}.toml"
    path.write_text(
        f"""
[aws]
region = "us-east-1"
endpoint_url = "{cloud.proxy.url}"
[fleet]
name = "{name}"
min_nodes = 2
max_nodes = 2
state_dir = "{tmp_path / name}"
reconcile_interval_s = 1.0
[capacity]
instance_types = ["g5.xlarge"]
zones = ["us-east-1b"]
ami_id = "{cloud.ami}"
subnet_ids = [{subnets}]
[budget]
total_usd = 1000.0
max_usd_per_hour = 100.0
stop_reserve_s = 60.0
[team]
member = true
"""
    )
    return path


async def one_pass(r: Reconciler) -> PassReport:
    """A pass, and the status file the daemon's publisher writes after it (fleetd/publish.py)."""
    report = await r.run_pass()
    assert report.plan is not None and report.observation is not None
    cfg = r.pass_cfg
    write_snapshot(
        r.cfg.fleet.state_dir,
        build_snapshot(
            now=report.now,
            fleet=r.cfg.fleet.name,
            reconcile_interval_s=1.0,
            nodes=report.observation.nodes,
            budget=report.plan.budget,
            budget_total_usd=cfg.budget.total_usd,
            budget_max_usd_per_hour=cfg.budget.max_usd_per_hour,
            stop_issued_at=report.observation.stop_issued_at,
            pools=r.pool_rows,
        ),
    )
    return report


def team(tmp_path: Path, max_usd_per_hour: float) -> TeamConfig:
    return TeamConfig(
        team=TeamGroup(
            name="lab", total_usd=50.0, max_usd_per_hour=max_usd_per_hour, min_pause_s=0.0, resume_margin=0.0
        ),
        jobs=(
            TeamJobEntry(name="hi", config=tmp_path / "hi.toml", priority=10),
            TeamJobEntry(name="lo", config=tmp_path / "lo.toml", priority=0),
        ),
    )


async def test_the_team_pauses_the_lower_job_when_money_tightens_and_resumes_it(cloud: Cloud, tmp_path: Path) -> None:
    clock = FakeClock(time.time())
    paths = {n: job_config(cloud, tmp_path, n) for n in ("hi", "lo")}
    async with (
        built_reconciler(cloud, load(paths["hi"]), clock) as hi,
        built_reconciler(cloud, load(paths["lo"]), clock) as lo,
    ):
        # No allotment yet: both jobs wait and buy nothing.
        for r in (hi, lo):
            await one_pass(r)
        assert await cloud.instances("hi") == [] and await cloud.instances("lo") == []

        # Room for both: each starts and grows to its maximum.
        done = await team_pass(team(tmp_path, 10.0), clock())
        assert {r.job: r.kind for r in done.written} == {"hi": "start", "lo": "start"}
        assert sum(r.total_usd for r in done.written) <= 50.0 + 1e-9
        for _ in range(3):
            for r in (hi, lo):
                await one_pass(r)
            clock.advance(1.0)
        assert len(await cloud.instances("hi")) == 2 and len(await cloud.instances("lo")) == 2
        assert await lo.state.get_meta(PAUSED_KEY) is None and await lo.state.get_meta("stop_issued_at") is None
        clock.advance(600.0)
        for r in (hi, lo):
            await one_pass(r)

        # The team may burn only what the higher job's two nodes cost: the lower one pauses.
        burn_hi = sum(n.price_per_hour for n in (await one_pass(hi)).observation.nodes)
        done = await team_pass(team(tmp_path, burn_hi * 1.2), clock())
        kinds = {r.job: r.kind for r in done.written}
        assert kinds["lo"] == "pause" and kinds["hi"] in ("keep", "shrink") and done.spent_usd > 0
        assert read_allotment(tmp_path / "lo").kind == "pause"
        report = await one_pass(lo)
        assert any(isinstance(o.action, StopJob) for o in report.outcomes)  # the coordinated checkpoint
        assert await lo.state.get_meta(PAUSED_KEY) is not None
        clock.advance(61.0)  # the stop's reserve: nodes that have not shut down are released
        for _ in range(2):
            await one_pass(lo)
            await one_pass(hi)
            clock.advance(1.0)
        assert await cloud.instances("lo") == []
        assert len(await cloud.instances("hi")) >= 1

        # Room again: the lower job resumes on fresh nodes, its stop undone.
        done = await team_pass(team(tmp_path, 10.0), clock())
        assert {r.job: r.kind for r in done.written}["lo"] == "resume"
        for _ in range(3):
            await one_pass(lo)
            clock.advance(1.0)
        assert await lo.state.get_meta(PAUSED_KEY) is None and await lo.state.get_meta("stop_issued_at") is None
        assert len(await cloud.instances("lo")) >= 1
