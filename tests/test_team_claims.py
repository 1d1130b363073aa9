"""The team's money with jobs it cannot plan for (fleetd/team/arbiter.py decide, fleetd/team/
claims.py): whatever mix of unreadable, stale, foreign, finished and planned jobs a pass sees,
the totals in force afterwards (written ones, and the old ones of jobs it skipped, or a foreign
job's own budget) add up to no more than the team's total; lowered shares are written first."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetd.config import BudgetConfig, FleetConfig, FleetdConfig, TeamMemberConfig
from fleetd.policy.team_model import TeamActionKind
from fleetd.shared.settings import AwsConfig
from fleetd.snapshot import BudgetView, NodeView, PoolView, StatusSnapshot
from fleetd.team.allotment_file import AllotmentRecord
from fleetd.team.arbiter import decide
from fleetd.team.config import TeamConfig, TeamGroup, TeamJobEntry
from fleetd.team.inputs import JobSeen

NOW = 10_000.0
EPS = 1e-6


def _cfg(name: str, member: bool, total: float, per_hour: float) -> FleetdConfig:
    return FleetdConfig(
        aws=AwsConfig(region="r"),
        fleet=FleetConfig(name=name, min_nodes=1, max_nodes=3, state_dir=Path(f"/s/{name}")),
        budget=BudgetConfig(total_usd=total, max_usd_per_hour=per_hour),
        team=TeamMemberConfig(member=member),
    )


@st.composite
def jobs(draw: st.DrawFn, i: int) -> JobSeen:
    name = f"j{i}"
    entry = TeamJobEntry(name=name, config=Path(f"/c/{name}.toml"), priority=draw(st.integers(0, 3)))
    kind = draw(st.sampled_from(["planned", "unreadable", "stale", "no-budget", "foreign", "over", "no-status"]))
    spent = draw(st.floats(0.0, 40.0))
    burn = draw(st.floats(0.0, 3.0))
    prev = None
    if draw(st.booleans()):
        prev = AllotmentRecord(
            team="t",
            job=name,
            written_at=NOW - 30,
            kind=draw(st.sampled_from(list(TeamActionKind))),
            nodes=draw(st.integers(0, 3)),
            usd_per_hour=draw(st.floats(0.0, 3.0)),
            total_usd=spent + draw(st.floats(0.0, 40.0)),
        )
    cfg = _cfg(name, kind != "foreign", draw(st.floats(1.0, 60.0)), draw(st.floats(0.5, 5.0)))
    if kind == "unreadable":
        return JobSeen(entry, problem="its config cannot be read", previous=prev)
    budget = (
        None
        if kind == "no-budget"
        else BudgetView(
            total_usd=100.0,
            max_usd_per_hour=20.0,
            spent_usd=spent,
            burn_usd_per_hour=burn,
            forecast_usd=spent,
            level="normal",
        )
    )
    job_view = None
    if kind == "over":
        from fleetd.job_record import JobView
        from fleetd.policy.job_state import JobState

        job_view = JobView(state=JobState.SUCCEEDED)
    nodes = (
        ()
        if burn == 0
        else (
            NodeView(
                instance_id=f"i-{name}",
                pool="g5.xlarge@a",
                market="spot",
                price_per_hour=burn,
                state="running",
                ec2_state="running",
                launched_at=0.0,
            ),
        )
    )
    snap = StatusSnapshot(
        fleet=name,
        written_at=NOW - (500.0 if kind == "stale" else 1.0),
        reconcile_interval_s=10.0,
        pools=(
            PoolView(
                pool="g5.xlarge@a", offered=True, spot_price=draw(st.floats(0.1, 2.0)), relative_throughput=1.0, gpus=1
            ),
        ),
        budget=budget,
        nodes=nodes,
        job=job_view,
    )
    if kind == "no-status":
        return JobSeen(entry, cfg, None, prev)
    problem = None if kind != "foreign" else "not a member"
    return JobSeen(entry, cfg, snap, prev, problem)


@st.composite
def passes(draw: st.DrawFn) -> tuple[TeamConfig, list[JobSeen]]:
    seen = [draw(jobs(i)) for i in range(draw(st.integers(1, 5)))]
    team = TeamGroup(name="t", total_usd=draw(st.floats(50.0, 400.0)), max_usd_per_hour=draw(st.floats(1.0, 20.0)))
    return TeamConfig(team=team, jobs=tuple(s.entry for s in seen)), seen


def in_force(seen: list[JobSeen], written: dict[str, AllotmentRecord]) -> float:
    """What every job may have spent in all once this pass's files are in place."""
    out = 0.0
    for s in seen:
        name = s.entry.name
        if s.cfg is not None and not s.cfg.team.member:
            out += max(s.cfg.budget.total_usd, s.spent_usd)  # the team does not steer it
        elif name in written:
            out += written[name].total_usd
        elif s.previous is not None:
            out += max(s.previous.total_usd, s.spent_usd)
        else:
            out += s.spent_usd  # a member with no share buys nothing
    return out


def committed(seen: list[JobSeen], cfg: TeamConfig) -> float:
    """What the jobs may spend whatever this pass writes (fleetd/team/claims.py's floor)."""
    from fleetd.team.claims import kept_claim, planned_claim, spend_known

    out = 0.0
    for s in seen:
        floor = kept_claim(s).spent_usd
        if spend_known(s) and s.cfg is not None and s.cfg.team.member:
            floor = max(floor, planned_claim(s, cfg.team.interval_s).spent_usd)
        out += floor
    return out


@settings(max_examples=150, deadline=None)
@given(passes())
def test_the_shares_in_force_never_add_up_to_more_than_the_team_may_spend(drawn) -> None:
    cfg, seen = drawn
    done = decide(cfg, seen, NOW)
    written = {r.job: r for r in done.written}
    after = in_force(seen, written)
    # Money already committed (spent, a share in force, a running job's tail until a lower share
    # stops it) cannot be taken back; beyond the team's total nothing is added to it.
    before = committed(seen, cfg)
    assert after <= max(cfg.team.total_usd, before) + EPS
    for r in done.written:
        assert r.total_usd >= 0 and r.usd_per_hour >= 0
    # Every prefix of the writes (the loop killed halfway) adds nothing to what was in force
    # before the pass beyond the total: lowered shares go first.
    was = in_force(seen, {})
    for k in range(len(done.written) + 1):
        partial = in_force(seen, {r.job: r for r in done.written[:k]})
        assert partial <= max(cfg.team.total_usd, before, was) + EPS


def test_a_job_it_cannot_read_keeps_its_share_and_the_others_do_not_get_it() -> None:
    a, b = TeamJobEntry(name="a", config=Path("/c/a.toml")), TeamJobEntry(name="b", config=Path("/c/b.toml"))
    prev_b = AllotmentRecord(
        team="t", job="b", written_at=NOW - 30, kind=TeamActionKind.KEEP, nodes=1, usd_per_hour=1.0, total_usd=60.0
    )
    snap = StatusSnapshot(
        fleet="a",
        written_at=NOW - 1,
        reconcile_interval_s=10.0,
        pools=(PoolView(pool="g5.xlarge@a", offered=True, spot_price=0.5, relative_throughput=1.0, gpus=1),),
        budget=BudgetView(
            total_usd=100.0,
            max_usd_per_hour=20.0,
            spent_usd=10.0,
            burn_usd_per_hour=0.0,
            forecast_usd=10.0,
            level="normal",
        ),
    )
    seen = [
        JobSeen(a, _cfg("a", True, 1000.0, 20.0), snap),
        JobSeen(b, problem="its config cannot be read", previous=prev_b),
    ]
    cfg = TeamConfig(team=TeamGroup(name="t", total_usd=100.0, max_usd_per_hour=10.0), jobs=(a, b))
    done = decide(cfg, seen, NOW)
    (ra,) = done.written
    assert ra.job == "a" and ra.total_usd <= 100.0 - 60.0 + EPS  # b's $60 stays b's
    assert "cannot be read" in done.skipped["b"]
