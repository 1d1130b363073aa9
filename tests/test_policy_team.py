"""The team allocator's rules, one by one (fleetd/policy/team.py, team_region.py; issue 33)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleetd.policy.team import allocate, team_room_usd_per_hour
from fleetd.policy.team_model import JobCap, RegionOffer, TeamActionKind, TeamBudget, TeamJob, TeamSettings

A = (RegionOffer("a", 1.0, 1.0),)
AB = (RegionOffer("a", 1.0, 1.0), RegionOffer("b", 1.5, 1.4))


def job(name: str, priority: int = 0, lo: int = 1, hi: int = 8, **kw: object) -> TeamJob:
    return TeamJob(name=name, priority=priority, min_nodes=lo, max_nodes=hi, offers=kw.pop("offers", A), **kw)  # type: ignore[arg-type]


def running(j: TeamJob, n: int, price: float = 1.0, region: str = "a") -> TeamJob:
    return replace(j, region=region, node_prices=(price,) * n)


def budget(per_hour: float, total: float = 1e6, spent: float = 0.0) -> TeamBudget:
    return TeamBudget(total_usd=total, max_usd_per_hour=per_hour, spent_usd=spent, horizon_s=3600.0)


def test_room_is_the_tighter_of_the_rate_cap_and_the_total_over_the_horizon() -> None:
    assert team_room_usd_per_hour(budget(10.0, total=100.0, spent=95.0)) == pytest.approx(5.0)
    assert team_room_usd_per_hour(budget(10.0, total=100.0, spent=0.0)) == pytest.approx(10.0)
    assert team_room_usd_per_hour(budget(10.0, total=100.0, spent=120.0)) == 0.0
    plan = allocate(budget(10.0, total=100.0, spent=95.0), [job("x")], {})
    assert plan.of("x").nodes == 5 and plan.forecast_usd <= 100.0 + 1e-9


def test_lower_priority_shrinks_first_then_pauses() -> None:
    hi, lo = running(job("hi", 5, lo=2), 4), running(job("lo", 1, lo=2), 4)
    plan = allocate(budget(6.0), [hi, lo], {})
    assert (plan.of("hi").nodes, plan.of("lo").nodes) == (4, 2)
    assert plan.of("lo").kind is TeamActionKind.SHRINK
    plan = allocate(budget(3.0), [hi, lo], {})
    assert (plan.of("hi").nodes, plan.of("lo").nodes) == (3, 0)
    assert plan.of("lo").kind is TeamActionKind.PAUSE
    assert "checkpoint first" in plan.of("lo").reason and "team budget" in plan.of("lo").reason


def test_needs_come_before_a_higher_jobs_extras() -> None:
    plan = allocate(budget(5.0), [job("hi", 5, lo=1), job("lo", 1, lo=2)], {})
    assert (plan.of("hi").nodes, plan.of("lo").nodes) == (3, 2)


def test_equal_priorities_share_in_proportion_to_their_minimum_sizes() -> None:
    plan = allocate(budget(9.0), [job("small", lo=1, hi=20), job("big", lo=2, hi=20)], {})
    assert (plan.of("small").nodes, plan.of("big").nodes) == (3, 6)


def test_a_running_job_keeps_its_need_before_an_equal_priority_newcomer() -> None:
    plan = allocate(budget(2.0), [job("new", lo=2), running(job("old", lo=2), 2)], {})
    assert plan.of("old").kind is TeamActionKind.KEEP
    assert plan.of("new").kind is TeamActionKind.PENDING and "team budget" in plan.of("new").reason


def test_paused_jobs_resume_highest_priority_first() -> None:
    paused = [replace(job(n, p, lo=2), region="a", paused=True) for n, p in (("p1", 1), ("p3", 3), ("p2", 2))]
    plan = allocate(budget(4.0), paused, {})
    assert [plan.of(n).kind for n in ("p3", "p2", "p1")] == [
        TeamActionKind.RESUME,
        TeamActionKind.RESUME,
        TeamActionKind.PAUSED,
    ]
    assert "stays paused" in plan.of("p1").reason


def test_a_job_that_cannot_start_is_pending_with_the_reason() -> None:
    plan = allocate(budget(100.0), [job("x", lo=4)], {"a": 3})
    a = plan.of("x")
    assert a.kind is TeamActionKind.PENDING and a.nodes == 0
    assert "capacity" in a.reason and "no allowed region has capacity for its 4 nodes" in a.reason


def test_per_job_caps_hold_under_the_team_budget() -> None:
    capped = job("capped", 5, cap=JobCap(max_usd_per_hour=3.0))
    totalled = job("totalled", 5, spent_usd=9.0, cap=JobCap(total_usd=10.0))
    plan = allocate(budget(100.0), [capped, totalled, job("other", 0, hi=4)], {})
    assert plan.of("capped").nodes == 3 and "its own cap" in plan.of("capped").reason
    assert plan.of("totalled").nodes == 1
    assert plan.of("other").nodes == 4


def test_a_deadline_job_gets_its_ask_first_within_its_priority_and_within_the_budget() -> None:
    plain, dl = job("plain", 1, lo=2), job("dl", 1, lo=1, deadline_nodes=5)
    plan = allocate(budget(7.0), [plain, dl], {})
    assert (plan.of("dl").nodes, plan.of("plain").nodes) == (5, 2)
    plan = allocate(budget(4.0), [plain, dl], {})
    assert plan.of("dl").nodes == 4 and "deadline at risk" in plan.of("dl").reason
    assert plan.of("plain").kind is TeamActionKind.PENDING


def test_shrinking_keeps_the_cheapest_nodes() -> None:
    j = replace(job("x"), region="a", node_prices=(3.0, 1.0, 2.0))
    plan = allocate(budget(3.0), [j], {})
    assert plan.of("x").nodes == 2 and plan.of("x").usd_per_hour == pytest.approx(3.0)


def test_a_new_job_goes_to_the_cheapest_region_with_capacity() -> None:
    offers = (RegionOffer("a", 1.0, 1.2), RegionOffer("b", 1.0, 0.9), RegionOffer("c", 1.0, 0.5))
    plan = allocate(budget(100.0), [job("x", lo=2, hi=2, offers=offers)], {"c": 1})
    assert plan.of("x").region == "b" and plan.of("x").kind is TeamActionKind.START
    assert "lowest expected $0.900" in plan.of("x").reason


def test_higher_priority_jobs_claim_region_capacity_first() -> None:
    jobs = [job("lo", 0, lo=2, hi=2, offers=AB), job("hi", 9, lo=2, hi=2, offers=AB)]
    plan = allocate(budget(100.0), jobs, {"a": 2, "b": 2})
    assert (plan.of("hi").region, plan.of("lo").region) == ("a", "b")


def test_a_running_job_stays_while_its_region_has_capacity_even_if_another_is_cheaper() -> None:
    offers = (RegionOffer("a", 1.0, 2.0), RegionOffer("b", 0.5, 0.5))
    plan = allocate(budget(100.0), [running(job("x", lo=2, hi=2, offers=offers), 2)], {"a": 2})
    assert plan.of("x").region == "a" and plan.of("x").kind is TeamActionKind.KEEP


def test_a_job_moves_when_its_region_is_dry_and_the_move_pays() -> None:
    dry = (RegionOffer("a", 3.0, 3.0), RegionOffer("b", 1.5, 1.4))  # staying: on-demand
    x = running(job("x", lo=2, hi=2, offers=dry, remaining_gpu_hours=100.0, checkpoint_gb=50.0), 2)
    plan = allocate(budget(100.0), [x], {"a": 0}, TeamSettings(transfer_usd_per_gb=0.02, changeover_h=0.25))
    a = plan.of("x")
    assert (a.kind, a.region, a.move_from, a.nodes) == (TeamActionKind.MOVE, "b", "a", 2)
    # saving 100 x (3.0 - 1.4) = 160 > copy 1.00 + changeover 0.25 h x $3.00/h
    assert "it pays: saving $160.00" in a.reason and "copy $1.00" in a.reason and "changeover $0.75" in a.reason


def test_a_job_does_not_move_when_the_move_does_not_pay() -> None:
    dry = (RegionOffer("a", 3.0, 1.5), RegionOffer("b", 1.5, 1.4))
    x = running(job("x", lo=2, hi=2, offers=dry, remaining_gpu_hours=2.0, checkpoint_gb=500.0), 2)
    a = allocate(budget(100.0), [x], {"a": 0}).of("x")
    assert (a.kind, a.region, a.nodes) == (TeamActionKind.PAUSE, "a", 0)
    assert "a move to b does not pay" in a.reason and "checkpoint first" in a.reason


def test_every_allotment_has_a_reason_and_the_plan_says_the_team_figures() -> None:
    plan = allocate(budget(3.0, total=50.0, spent=10.0), [job("a", 1), job("b", 0, lo=3)], {})
    assert all(a.reason for a in plan.allotments)
    assert "spent $10.00 of $50.00" in plan.reason and "may burn $3.00/h" in plan.reason


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        allocate(budget(1.0), [job("x"), job("x")], {})
    with pytest.raises(ValueError, match="min_nodes"):
        job("x", lo=3, hi=2)
    with pytest.raises(ValueError, match="horizon"):
        TeamBudget(1.0, 1.0, 0.0, 0.0)


# Extras by marginal value (rule 3) and resume hysteresis (rule 4).


def test_extras_go_where_the_next_node_adds_most_useful_work_per_dollar() -> None:
    poor = job("poor", lo=1, hi=8, useful_nodes=(1.0, 1.5, 1.9, 2.2))  # each node adds less
    good = job("good", lo=1, hi=8)  # ideal scaling
    plan = allocate(budget(6.0), [poor, good], {})
    assert (plan.of("good").nodes, plan.of("poor").nodes) == (5, 1)


def test_a_higher_priority_takes_extras_first_only_within_the_band() -> None:
    hi = job("hi", 5, lo=1, hi=8, useful_nodes=(1.0, 1.8, 2.5))  # node 2 adds 0.8
    lo = job("lo", 1, lo=1, hi=8)  # node 2 adds 1.0
    wide = allocate(budget(3.0), [hi, lo], {})  # the default band, 30 %
    assert (wide.of("hi").nodes, wide.of("lo").nodes) == (2, 1)  # 0.8 >= 0.7 x 1.0: priority
    narrow = allocate(budget(3.0), [hi, lo], {}, TeamSettings(extra_priority_band=0.1))
    assert (narrow.of("hi").nodes, narrow.of("lo").nodes) == (1, 2)  # 0.8 < 0.9 x 1.0: the cheaper step


def test_no_extra_node_below_the_jobs_min_marginal_efficiency() -> None:
    x = job("x", lo=1, hi=8, useful_nodes=(1.0, 1.9, 2.4), min_marginal_efficiency=0.7)
    a = allocate(budget(100.0), [x], {}).of("x")
    # node 3 adds 0.5 for $1/h against an average of 1.9 / $2/h: 53 % < 70 %
    assert a.nodes == 2 and "its scaling: node 3" in a.reason and "min_marginal_efficiency 70%" in a.reason


def _paused(name: str, priority: int, lo: int, at: float) -> TeamJob:
    return replace(job(name, priority, lo=lo, hi=lo), region="a", paused=True, paused_at=at)


def test_a_paused_job_waits_out_a_dip_until_it_fits_with_margin_or_has_waited() -> None:
    x = _paused("x", 1, 4, at=1000.0)
    tight = allocate(budget(100.0), [x], {"a": 5}, now=1100.0).of("x")
    assert tight.kind is TeamActionKind.PAUSED and "waits out the dip" in tight.reason
    assert allocate(budget(100.0), [x], {"a": 6}, now=1100.0).of("x").kind is TeamActionKind.RESUME
    assert allocate(budget(100.0), [x], {"a": 5}, now=1000.0 + 1800.0).of("x").kind is TeamActionKind.RESUME
    assert allocate(budget(100.0), [x], {"a": 5}).of("x").kind is TeamActionKind.RESUME  # no clock: no hold


def test_a_paused_job_does_not_resume_when_the_total_would_not_last() -> None:
    x = _paused("x", 1, 1, at=0.0)
    # $1.30 left: room $1.30/h for the 1 h horizon, but not for 1 h + 2 x 0.25 h changeover
    a = allocate(budget(10.0, total=11.3, spent=10.0), [x], {}, now=1e6).of("x")
    assert a.kind is TeamActionKind.PAUSED and "would not keep" in a.reason
    b = allocate(budget(10.0, total=11.6, spent=10.0), [x], {}, now=1e6).of("x")
    assert b.kind is TeamActionKind.RESUME


def test_a_held_job_resumes_anyway_rather_than_leave_its_room_to_a_lower_one() -> None:
    hi, lo = _paused("hi", 5, 2, at=0.0), running(job("lo", 1, lo=1, hi=1), 1)
    plan = allocate(budget(100.0), [hi, lo], {"a": 3}, now=60.0)  # hi fits, without margin
    assert plan.of("hi").kind is TeamActionKind.RESUME and plan.of("lo").kind is TeamActionKind.KEEP


def test_a_lower_job_does_not_resume_into_the_room_a_higher_one_just_left() -> None:
    hi = running(job("hi", 5, lo=4, hi=4), 3)  # lost a node: its need no longer fits
    lo = _paused("lo", 1, 2, at=0.0)
    plan = allocate(budget(100.0), [hi, lo], {"a": 3}, now=120.0)
    assert plan.of("hi").kind is TeamActionKind.PAUSE
    assert plan.of("lo").kind is TeamActionKind.PAUSED and "the room is hi's" in plan.of("lo").reason


def test_a_deadline_ask_above_the_minimum_shrinks_but_never_pauses_a_running_lower_job() -> None:
    dl = running(job("dl", 5, lo=2, hi=8, deadline_nodes=6), 6)
    lo = running(job("lo", 1, lo=2, hi=4), 2)
    plan = allocate(budget(100.0), [dl, lo], {"a": 6})  # a dip: 6 nodes for 8
    assert (plan.of("dl").nodes, plan.of("lo").nodes) == (4, 2)
    assert "deadline at risk" in plan.of("dl").reason and plan.of("lo").kind is TeamActionKind.KEEP
    new = replace(lo, region=None, node_prices=())  # a job not running yet does not hold it back
    assert allocate(budget(100.0), [dl, new], {"a": 6}).of("dl").nodes == 6
