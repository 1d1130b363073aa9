"""The omniscient reference (fleetd/sim/omniscient.py): known answers on hand-made traces, and a
lower bound in fact: no simulated policy, fleetd's included, pays less on the same window."""

from __future__ import annotations

import pytest

from fleetd.sim.deadline import random_offsets, sweep
from fleetd.sim.defaults import prices_for
from fleetd.sim.job import JobSpec
from fleetd.sim.omniscient import SLOT_S, fleet, reference, single_node, spot_run_end
from fleetd.sim.traces import ADD, REMOVE, Trace, TraceEvent, load_trace

H = 3600.0


NEVER, NONE = [30] * 30, list(range(30))  # spot_run_end: a node that is never removed / no node


@pytest.mark.parametrize(
    ("run_end", "work", "deadline", "changeover", "cost"),
    [
        (NEVER, 10, 30, 0, 10.0),  # all on spot
        (NEVER, 10, 30, 2, 12.0),  # one start: two changeover slots
        (NONE, 10, 30, 2, 36.0),  # no spot: on-demand, with its changeover
        ([5] * 5 + NONE[5:], 10, 30, 1, 26.0),  # 4 slots on spot, then on-demand (a second changeover)
        (list(range(11)), 10, 11, 2, None),  # impossible even on on-demand
    ],
)
def test_one_node_known_answers(run_end, work, deadline, changeover, cost) -> None:
    assert single_node(run_end, work, deadline, changeover, 1.0, 3.0, slot_s=H) == cost


def test_a_spot_start_takes_the_node_that_lasts_longest_and_a_removal_costs_a_changeover() -> None:
    # A lives [0, 4) h, B [2, 8) h. Counting offered nodes alone, spot would run 0-8 h unbroken;
    # node by node, A's removal ends its run. Best: A 0-4 (3 h trained), B 4-8 (3 h), on-demand
    # for the last 4 h with its changeover: 4 + 4 + 5 x 3 = 23.
    tr = Trace(
        "t",
        (
            TraceEvent(0, ADD, "A"),
            TraceEvent(2 * H, ADD, "B"),
            TraceEvent(4 * H, REMOVE, "A"),
            TraceEvent(8 * H, REMOVE, "B"),
        ),
        20 * H,
    )
    ends = spot_run_end(tr, 20, slot_s=H, choose="longest")
    assert ends[:3] == [4, 4, 8] and ends[9] == 9
    assert single_node(ends, 10, 20, 1, 1.0, 3.0, slot_s=H) == 23.0
    # As EC2 (and the simulator) hands nodes out, the one offered longest comes first: A until 4 h.
    assert spot_run_end(tr, 20, slot_s=H, choose="first")[:5] == [4, 4, 4, 4, 8]


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
    """Up to the slot grid: the reference starts and ends runs on slot boundaries and rounds the
    work up to whole slots, so a policy may pay up to a few slots' price less."""
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
            grid = 3 * od * nodes * SLOT_S / H
            if r.deadline_met:
                assert r.cost_usd >= ref - grid, (policy, start, r.cost_usd, ref)
