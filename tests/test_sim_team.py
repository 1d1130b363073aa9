"""`fleetd simulate --jobs N`: the team allocator against the same jobs on a split budget (issue 33)."""

from __future__ import annotations

import argparse
import json

import pytest

from fleetd.commands import simulate
from fleetd.sim.team import run_team
from fleetd.sim.team_cli import build


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    simulate.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture(scope="module")
def p3_two_regions() -> tuple[object, ...]:
    sc, _ = build(_args("--trace", "p3", "--region-trace", "g4dn", "--jobs", "3", "--deadline-h", "8"))
    return sc, run_team(sc, "team"), run_team(sc, "split")


def test_both_arms_stay_inside_their_budgets(p3_two_regions: tuple) -> None:
    sc, team, split = p3_two_regions
    assert team.spend_usd <= sc.total_usd + 1e-6
    assert team.max_burn_usd_per_hour <= sc.max_usd_per_hour + 1e-6
    share = sc.total_usd / len(sc.jobs)
    assert all(j.spend_usd <= share + 1e-6 for j in split.jobs)


def test_the_team_serves_its_highest_priority_first(p3_two_regions: tuple) -> None:
    _, team, split = p3_two_regions
    prod = next(j for j in team.jobs if j.name == "prod")
    assert prod.finished_at_h is not None and prod.deadline_met
    assert team.steps_done > split.steps_done
    assert all(d for d in team.decisions)


def test_cli_prints_one_json_object_with_both_arms(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args("--trace", "g4dn", "--jobs", "2", "--json")
    assert simulate.run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [a["mode"] for a in doc["arms"]] == ["team", "split"]
    assert all(a["within_budget"] for a in doc["arms"])
    assert {"name", "steps_done", "spend_usd", "pauses", "moves"} <= set(doc["arms"][0]["jobs"][0])


def test_cli_table_and_bad_job_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate.run(_args("--trace", "p3", "--jobs", "1")) == 0
    assert "$/1k steps" in capsys.readouterr().out
    assert simulate.run(_args("--trace", "p3", "--jobs", "0")) == 2
