"""The omniscient reference (fleetd/sim/omniscient.py): known answers on hand-made traces, and a
lower bound in fact: no simulated policy, fleetd's included, pays less on the same window."""

from __future__ import annotations

import pytest

from fleetd.sim.deadline import random_offsets, sweep
from fleetd.sim.defaults import prices_for
from fleetd.sim.job import JobSpec
from fleetd.sim.omniscient import fleet, reference, single_node
from fleetd.sim.traces import load_trace

H = 3600.0


@pytest.mark.parametrize(
    ("offered", "work", "deadline", "changeover", "cost"),
    [
        ([1] * 30, 10, 30, 0, 10.0),  # all on spot
        ([1] * 30, 10, 30, 2, 12.0),  # one start: two changeover slots
        ([0] * 30, 10, 30, 2, 36.0),  # no spot: on-demand, with its changeover
        ([1] * 5 + [0] * 25, 10, 30, 1, 26.0),  # 4 slots on spot, then on-demand (a second changeover)
        ([1, 0] * 15, 10, 30, 0, 10.0),  # spot every other slot, no changeover: wait for it
        ([1, 0] * 15, 10, 30, 1, 33.0),  # ... with one: every spot start costs as much as it trains
        ([0] * 11, 10, 11, 2, None),  # impossible even on on-demand
    ],
)
def test_one_node_known_answers(offered, work, deadline, changeover, cost) -> None:
    assert single_node(offered, work, deadline, changeover, 1.0, 3.0, slot_s=H) == cost


def test_a_fleet_takes_spot_first_and_on_demand_for_what_the_deadline_needs() -> None:
    job = JobSpec(total_steps=8 * H, max_nodes=2, scaling_efficiency_per_doubling=1.0, deadline_s=4 * H)
    # One spot node offered, 8 node-hours due in 4 h: 4 spot hours and 4 on-demand hours.
    assert fleet([1] * 4, job, 8 * H, 4, 1.0, 3.0, slot_s=H) == pytest.approx(16.0)
    assert fleet([2] * 4, job, 8 * H, 4, 1.0, 3.0, slot_s=H) == pytest.approx(8.0)
    assert fleet([0] * 3, job, 8 * H, 3, 1.0, 3.0, slot_s=H) is None


@pytest.mark.parametrize(
    ("trace_name", "itype", "nodes"), [("p3", "p3.2xlarge", 1), ("g4dn", "g4dn.xlarge", 1), ("p3", "p3.2xlarge", 4)]
)
def test_no_policy_pays_less_than_the_reference_on_the_same_window(trace_name, itype, nodes) -> None:
    trace = load_trace(trace_name)
    spot, od = prices_for(itype)
    base = JobSpec(total_steps=1.0, max_nodes=nodes, deadline_s=9 * H, checkpoint_stall_s=0.0, no_notice_share=0.0)
    job = base.with_(total_steps=6 * H * base.throughput(nodes))
    starts = random_offsets(trace, 4, seed=3)
    runs = sweep(trace, job, itype, spot, od, 0.1 * H, starts)
    for i, start in enumerate(starts):
        ref = reference(trace.window(start), job, spot, od, 0.1 * H)
        assert ref is not None
        for policy, results in runs.items():
            r = results[i]
            if r.deadline_met:
                assert r.cost_usd >= ref - 1e-6, (policy, start, r.cost_usd, ref)
