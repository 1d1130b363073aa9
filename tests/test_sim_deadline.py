"""Deadline jobs in the simulator: the planner's own rule (fleetd/policy/deadline.py) against
Uniform Progress with the same changeover d for every policy (issue 15's repro, one node and a
fleet), through the CLI."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from fleetd.cli import main


def simulate(*args: str) -> dict[str, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["simulate", "--trace", "p3", "--policy", "all", "--json", *args]) == 0
    return {r["policy"]: r for r in json.loads(out.getvalue())}


@pytest.mark.parametrize("d_h", ["0.2", "0.3", "0.5"])
def test_one_node_meets_the_deadline_and_costs_no_more_than_uniform_progress(d_h) -> None:
    # Issue 15: past d = 0.28 h fleetd fell back to on-demand for good (40 % saved vs UP's 80 %).
    res = simulate("--max-nodes", "1", "--work-node-hours", "6", "--deadline-h", "9", "--changeover-h", d_h)
    assert set(res) == {"on-demand", "greedy", "uniform-progress", "fleetd"}
    assert all(r["deadline_met"] for r in res.values())
    assert res["fleetd"]["cost_usd"] <= res["uniform-progress"]["cost_usd"] + 1e-6


@pytest.mark.parametrize("d_h", ["0.05", "0.3", "0.5"])
def test_a_fleet_meets_the_deadline_and_costs_no_more_than_uniform_progress(d_h) -> None:
    res = simulate("--max-nodes", "4", "--work-node-hours", "24", "--deadline-h", "9", "--changeover-h", d_h)
    assert all(r["deadline_met"] for r in res.values())
    assert res["fleetd"]["cost_usd"] <= res["uniform-progress"]["cost_usd"] + 1e-6
    assert res["fleetd"]["cost_usd"] < res["on-demand"]["cost_usd"]


def test_every_policy_gets_the_same_changeover(capsys) -> None:
    assert main(["simulate", "--trace", "p3", "--max-nodes", "1", "--deadline-h", "9", "--changeover-h", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "changeover d 0.3 h, every policy" in out
    with pytest.raises(SystemExit):  # no longer an option: one d for every policy
        main(["simulate", "--trace", "p3", "--fleetd-changeover-h", "0.05"])
