"""The deadline rule's no-miss guarantee (DESIGN.md "The no-miss guarantee"), as a property: the
planner's own rule (fleetd/policy/deadline.py through fleetd/policy/planner.py), driven by the
simulator over random spot traces, prices, changeovers d, fleet sizes, scaling and slack, never
misses a deadline the job could meet at its start under the stated assumptions:

- on-demand is always available and a bought node trains d after the pass that buys it (the
  simulator's on-demand pool never runs out; every node pays d before it trains);
- progress survives a loss (Can't Be Late's model: no checkpoint stall, every loss noticed);
- the job's pace at the target size is known (job.steps_per_s) and per-node throughput does not
  rise with the fleet size (scaling efficiency per doubling <= 1);
- the budget never blocks on-demand;
- each membership change stalls the members for reform_s (5 s), and d > (2N + 1) x that;
- feasible at the start: the deadline leaves at least 2d beyond the work at the full size (UP's
  premise), or (second property) at least d plus a minute.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetd.sim.job import JobSpec
from fleetd.sim.scenario import Scenario
from fleetd.sim.traces import SyntheticPool, synthetic_trace

H = 3600.0
REFORM_S = 5.0


@st.composite
def deadline_cases(draw, min_slack_d: float, max_slack_d: float | None) -> tuple[Scenario, dict]:
    nodes = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    d = draw(st.floats(0.03, 0.5)) * H
    work = draw(st.floats(0.25, 6.0)) * H
    if max_slack_d is None:  # >= 2d: tight (just 2d) to loose (2d + twice the work)
        extra = draw(st.one_of(st.just(0.0), st.floats(0.0, 0.05), st.floats(0.0, 2.0)))
        slack = min_slack_d * d + extra * work
    else:
        slack = draw(st.floats(min_slack_d, max_slack_d)) * d
    slack = max(slack, d + 60.0)
    deadline = work + slack
    # One spot pool: from calm to hostile (many short outages, one node at a time or pool-wide
    # waves), sometimes smaller than the fleet.
    pool = SyntheticPool(
        "p",
        nodes=draw(st.integers(1, nodes + 2)),
        interruptions_per_hour=draw(st.one_of(st.floats(0.0, 4.0), st.floats(4.0, 30.0))),
        mean_outage_s=draw(st.one_of(st.floats(30.0, 600.0), st.floats(600.0, 3 * H))),
        pool_wide_share=draw(st.one_of(st.just(0.0), st.just(1.0), st.floats(0.0, 1.0))),
    )
    trace = synthetic_trace([pool], 3 * deadline + H, seed=draw(st.integers(0, 2**31)))
    od = draw(st.floats(0.5, 40.0))
    spot = od * draw(st.floats(0.05, 0.95))
    eff = draw(st.floats(0.8, 1.0))
    base = JobSpec(
        total_steps=1.0,
        max_nodes=nodes,
        min_nodes=1,
        deadline_s=deadline,
        checkpoint_stall_s=0.0,
        no_notice_share=0.0,
        scaling_efficiency_per_doubling=eff,
    )
    job = base.with_(total_steps=work * base.throughput(nodes))
    sc = Scenario(trace, job, "p3.2xlarge", spot, od, changeover_s=d, reform_s=REFORM_S)
    return sc, {"nodes": nodes, "d_h": d / H, "work_h": work / H, "slack_h": slack / H}


def _assert_meets(sc: Scenario, case: dict) -> None:
    assert REFORM_S * (2 * case["nodes"] + 1) < case["d_h"] * H  # the stated assumption
    res = sc.run("fleetd")
    assert res.completed, case
    assert res.deadline_met, (case, res.finished_at_s, res.actions[-20:])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(deadline_cases(2.0, None))
def test_fleetd_never_misses_a_deadline_with_two_changeovers_of_slack(case) -> None:
    _assert_meets(*case)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(deadline_cases(1.0, 2.0))
def test_fleetd_never_misses_a_deadline_with_one_changeover_and_a_minute_of_slack(case) -> None:
    _assert_meets(*case)
