"""A job's share of the team (fleetd/policy/team_share.py, pure) and the allocator's view of a job
read from its files (fleetd/team/inputs.py, pure)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetd.config import BudgetConfig, FleetConfig, FleetdConfig, TeamMemberConfig
from fleetd.policy.team import allocate
from fleetd.policy.team_model import JobCap, RegionOffer, TeamActionKind, TeamBudget, TeamJob
from fleetd.policy.team_share import Share, job_totals, within_share
from fleetd.shared.settings import AwsConfig
from fleetd.snapshot import BudgetView, NodeView, PoolView, StatusSnapshot
from fleetd.team.allotment_file import AllotmentRecord
from fleetd.team.config import TeamJobEntry
from fleetd.team.inputs import JobSeen, offer_of, paused_at, team_job

EPS = 1e-6


def cfg(min_nodes: int = 1, max_nodes: int = 4, total: float = 100.0, per_hour: float = 20.0) -> FleetdConfig:
    return FleetdConfig(
        aws=AwsConfig(region="us-east-1"),
        fleet=FleetConfig(name="j", min_nodes=min_nodes, max_nodes=max_nodes),
        budget=BudgetConfig(total_usd=total, max_usd_per_hour=per_hour),
        team=TeamMemberConfig(member=True),
    )


def share(kind: TeamActionKind = TeamActionKind.KEEP, nodes: int = 2, usd: float = 1.0, total: float = 50.0) -> Share:
    return Share(kind, nodes, usd, total, written_at=1000.0, reason="because")


def test_the_planner_gets_the_smaller_of_its_own_limits_and_the_share() -> None:
    b = within_share(cfg(min_nodes=3, max_nodes=4), share(nodes=2, usd=1.5, total=50.0), now=1010.0)
    assert not b.paused
    assert (b.cfg.fleet.min_nodes, b.cfg.fleet.max_nodes) == (2, 2)
    assert (b.cfg.budget.max_usd_per_hour, b.cfg.budget.total_usd) == (1.5, 50.0)
    # The job's own limits stay when they are the smaller ones.
    b = within_share(cfg(max_nodes=4, total=20.0, per_hour=1.0), share(nodes=8, usd=9.0, total=70.0), now=1010.0)
    assert (b.cfg.fleet.max_nodes, b.cfg.budget.max_usd_per_hour, b.cfg.budget.total_usd) == (4, 1.0, 20.0)
    assert "10 s old" in b.note and "because" in b.note


def test_no_share_a_pause_or_nothing_allotted_trains_nowhere() -> None:
    assert within_share(cfg(), None, now=0.0).paused
    for kind in (TeamActionKind.PAUSE, TeamActionKind.PAUSED, TeamActionKind.PENDING):
        assert within_share(cfg(), share(kind), now=1000.0).paused
    assert within_share(cfg(), share(nodes=0), now=1000.0).paused
    assert within_share(cfg(), share(total=0.0), now=1000.0).paused


def _job(name: str, priority: int, price: float, lo: int = 1, hi: int = 3, spent: float = 0.0) -> TeamJob:
    return TeamJob(
        name=name,
        priority=priority,
        min_nodes=lo,
        max_nodes=hi,
        offers=(RegionOffer("r", price, price),),
        region="r",
        spent_usd=spent,
    )


def test_the_totals_split_what_is_left_by_allotted_burn_and_add_up_to_the_team_total() -> None:
    jobs = [_job("a", 2, 1.0, spent=10.0), _job("b", 1, 2.0, spent=5.0), _job("c", 0, 1.0, lo=4, hi=4, spent=1.0)]
    budget = TeamBudget(total_usd=100.0, max_usd_per_hour=6.0, spent_usd=16.0, horizon_s=3600.0)
    plan = allocate(budget, jobs, {})
    kinds = {a.job: a.kind for a in plan.allotments}
    assert kinds["c"] in (TeamActionKind.PENDING, TeamActionKind.PAUSE)  # 4 nodes at $1 do not fit beside a and b
    totals = job_totals(plan, budget, {"a": 10.0, "b": 5.0, "c": 1.0}, {})
    assert abs(sum(totals.values()) - 100.0) < EPS
    assert totals["c"] == 1.0  # no burn, no share of what is left: it may not spend more
    burn = {a.job: a.usd_per_hour for a in plan.allotments}
    assert abs((totals["a"] - 10.0) / (totals["b"] - 5.0) - burn["a"] / burn["b"]) < 1e-6
    # A job's own cap lowers its total, and nobody else's grows.
    capped = job_totals(plan, budget, {"a": 10.0, "b": 5.0, "c": 1.0}, {"a": JobCap(total_usd=12.0)})
    assert capped["a"] == 12.0 and capped["b"] == totals["b"]


@settings(max_examples=150, deadline=None)
@given(
    total=st.floats(1.0, 500.0),
    per_hour=st.floats(0.5, 30.0),
    spent=st.lists(st.floats(0.0, 50.0), min_size=1, max_size=5),
    prices=st.lists(st.floats(0.1, 5.0), min_size=5, max_size=5),
    mins=st.lists(st.integers(1, 3), min_size=5, max_size=5),
)
def test_the_jobs_totals_never_add_up_to_more_than_the_team_may_spend(total, per_hour, spent, prices, mins) -> None:
    """Property: every daemon stopping at its own total keeps the team inside its budget, and
    each job's total leaves its allotted burn room for the horizon (no job stops early)."""
    jobs = [_job(f"j{i}", i % 3, prices[i], lo=mins[i], hi=mins[i] + 2, spent=s) for i, s in enumerate(spent)]
    team_spent = sum(spent)
    budget = TeamBudget(
        total_usd=max(total, team_spent), max_usd_per_hour=per_hour, spent_usd=team_spent, horizon_s=3600.0
    )
    plan = allocate(budget, jobs, {})
    totals = job_totals(plan, budget, {j.name: j.spent_usd for j in jobs}, {})
    assert sum(totals.values()) <= budget.total_usd + EPS
    for a in plan.allotments:
        spent_a = next(j.spent_usd for j in jobs if j.name == a.job)
        assert totals[a.job] >= spent_a - EPS
        assert totals[a.job] - spent_a >= a.usd_per_hour * budget.horizon_s / 3600.0 - 1e-6


def _snapshot(pools=(), nodes=(), spent: float = 0.0, checkpoint=None) -> StatusSnapshot:
    return StatusSnapshot(
        fleet="j",
        written_at=0.0,
        reconcile_interval_s=10.0,
        nodes=tuple(nodes),
        pools=tuple(pools),
        budget=BudgetView(
            total_usd=100.0,
            max_usd_per_hour=20.0,
            spent_usd=spent,
            burn_usd_per_hour=0.0,
            forecast_usd=spent,
            level="normal",
        ),
        checkpoint=checkpoint,
    )


def _pool(name: str, spot: float, rel: float = 1.0, offered: bool = True) -> PoolView:
    return PoolView(pool=name, offered=offered, spot_price=spot, relative_throughput=rel, gpus=1)


def _node(iid: str, price: float, ec2_state: str = "running") -> NodeView:
    return NodeView(
        instance_id=iid,
        pool="g5.xlarge@us-east-1a",
        market="spot",
        price_per_hour=price,
        state="running",
        ec2_state=ec2_state,
        launched_at=0.0,
    )


NOW = 1_000.0
ENTRY = TeamJobEntry(name="j", config=Path("/etc/fleetd/j.toml"), priority=3, max_usd_per_hour=5.0)


def test_a_job_is_priced_by_its_cheapest_useful_pool_and_placed_once_it_has_nodes_or_a_checkpoint() -> None:
    pools = [
        _pool("g4dn.xlarge@a", 0.22, rel=0.33),
        _pool("g5.xlarge@a", 0.41),
        _pool("g6.xlarge@a", 0.1, offered=False),
    ]
    fresh = JobSeen(ENTRY, cfg(), _snapshot(pools))
    offer = offer_of(fresh, NOW)
    assert offer is not None and offer.region == "us-east-1" and offer.node_price_per_hour == 0.41
    view = team_job(fresh, NOW)
    assert isinstance(view, TeamJob) and view.region is None and view.priority == 3
    assert view.cap == JobCap(None, 5.0)
    running = team_job(
        JobSeen(ENTRY, cfg(), _snapshot(pools, [_node("i-1", 0.4), _node("i-2", 0.5, "terminated")], 2.0)), NOW
    )
    assert isinstance(running, TeamJob) and running.region == "us-east-1"
    assert running.node_prices == (0.4,) and running.spent_usd == 2.0


def test_a_paused_job_keeps_its_pause_time_and_a_job_that_cannot_be_read_says_why() -> None:
    prev = AllotmentRecord(
        team="t", job="j", written_at=50.0, kind="pause", nodes=0, usd_per_hour=0.0, total_usd=3.0, paused_at=50.0
    )
    view = team_job(JobSeen(ENTRY, cfg(), _snapshot([_pool("g5.xlarge@a", 0.41)]), prev), NOW)
    assert isinstance(view, TeamJob) and view.paused and view.paused_at == 50.0 and view.region == "us-east-1"
    assert paused_at(TeamActionKind.PAUSED, prev, 99.0) == 50.0
    assert paused_at(TeamActionKind.PAUSE, None, 99.0) == 99.0
    assert paused_at(TeamActionKind.KEEP, prev, 99.0) is None
    assert "no status" in team_job(JobSeen(ENTRY, cfg()), NOW)
    assert "no priced spot pool" in team_job(JobSeen(ENTRY, cfg(), _snapshot([_pool("x@a", 0.3, offered=False)])), NOW)
    assert team_job(JobSeen(ENTRY, problem="its config cannot be read: boom"), NOW) == "its config cannot be read: boom"
