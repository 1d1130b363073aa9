"""What a job asks of the team allocator (fleetd/policy/team_asks.py): the deadline's node count
and the measured scaling curve, as the simulator's team replay and the control host's loop
(fleetd/team/inputs.py) both read them."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from fleetd.policy.team_asks import deadline_ask, scaling_curve, throughput_at
from fleetd.team.inputs import JobSeen, deadline_nodes, team_job
from tests.test_team_regions import NOW, cfg, entry, node_view, pool, snapshot


def test_the_scaling_curve_is_each_measured_size_over_one_nodes_pace() -> None:
    assert scaling_curve({}) == ()
    assert scaling_curve({1: 2.0, 2: 3.8, 4: 7.2}) == pytest.approx((1.0, 1.9, 2.75, 3.6))  # 3: interpolated
    # No single-node measurement: the smallest size's pace per node, ideal below it.
    assert scaling_curve({2: 4.0, 3: 5.4}) == pytest.approx((1.0, 2.0, 2.7))
    rate = throughput_at({1: 2.0, 2: 3.8}, None)
    assert rate is not None and rate(2) == pytest.approx(3.8) and rate(3) == pytest.approx(5.6)  # +1.8 per node
    declared = throughput_at({}, 1.5)
    assert declared is not None and declared(4) == 6.0
    assert throughput_at({}, None) is None


def test_a_deadline_asks_for_the_smallest_fleet_that_keeps_it() -> None:
    rate = throughput_at({1: 1.0, 2: 1.9, 3: 2.7, 4: 3.4}, None)
    assert rate is not None
    assert deadline_ask(left_steps=1_000, time_left_s=1_000, throughput=rate, max_nodes=4) == 2  # 1.1 steps/s
    assert deadline_ask(left_steps=3_000, time_left_s=1_000, throughput=rate, max_nodes=4) == 4  # short: all
    assert deadline_ask(left_steps=10, time_left_s=1_000, throughput=rate, max_nodes=4) == 1


def test_the_control_host_reads_the_deadline_ask_and_the_curve_from_the_jobs_status() -> None:
    deadline = datetime.fromtimestamp(NOW + 3_600 + 720, tz=UTC)  # an hour after one changeover
    job = cfg(Path("/var/lib/fleetd/d"), total_steps=10_000, deadline=deadline)
    measured = snapshot([pool("g5@a", 0.4, 1.0)], (node_view("i-1", step=1_000),)).model_copy(
        update={"throughput_by_nodes": {1: 2.0, 2: 3.8}}
    )
    seen = JobSeen(entry("d"), job, measured)
    assert deadline_nodes(seen, NOW) == 2  # 9,000 steps in an hour: 2.75/s, more than 1 node's 2.0
    view = team_job(seen, NOW)
    assert not isinstance(view, str) and view.deadline_nodes == 2 and view.useful_nodes == pytest.approx((1.0, 1.9))
    # Pace unknown: it asks for its whole size rather than risk the deadline; no deadline: no ask.
    blind = JobSeen(entry("d"), job, snapshot([pool("g5@a", 0.4, 1.0)]))
    assert deadline_nodes(blind, NOW) == job.fleet.max_nodes
    assert deadline_nodes(JobSeen(entry("d"), cfg(), measured), NOW) is None
