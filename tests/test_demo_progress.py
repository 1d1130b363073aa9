"""The demo's measurements from the trainers' event trace: steps lost and the pause per change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetd.demo.progress import Progress
from fleetd.demo.scenario import NAMED, resolve


def _write(path: Path, recs: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n{cut by a SIGKILL")
    return path


def _steps(t0: float, world: int, first: int, last: int, dt: float = 0.1) -> list[dict]:
    return [
        {"ev": "step", "t": t0 + i * dt, "rank": r, "world": world, "step": s}
        for i, s in enumerate(range(first, last + 1))
        for r in range(world)
    ]


def test_a_clean_leave_loses_nothing_and_the_pause_is_measured(tmp_path: Path) -> None:
    recs = _steps(0.0, 3, 1, 50)  # last step of world 3 at t=4.9
    recs += [{"ev": "start", "t": 6.0 + 0.01 * r, "rank": r, "world": 2, "from_step": 50} for r in range(2)]
    recs += _steps(6.5, 2, 51, 60)
    p = Progress.load(_write(tmp_path / "ev.jsonl", recs))
    (restart,) = p.restarts()
    assert (restart.world, restart.from_step, restart.last_step_before, restart.steps_lost) == (2, 50, 50, 0)
    back = p.training_again_at(restart.at, restart.world)
    assert back == pytest.approx(6.5)
    assert p.final_step == 60 and p.max_world_size == 3


def test_resuming_from_an_older_step_counts_the_lost_steps(tmp_path: Path) -> None:
    recs = _steps(0.0, 2, 1, 40)
    recs += [{"ev": "start", "t": 9.0, "rank": 0, "world": 1, "from_step": 30}]
    recs += _steps(9.5, 1, 31, 35)
    (restart,) = Progress.load(_write(tmp_path / "ev.jsonl", recs)).restarts()
    assert restart.steps_lost == 10


def test_missing_trace_is_empty(tmp_path: Path) -> None:
    p = Progress.load(tmp_path / "none.jsonl")
    assert p.final_step == 0 and p.restarts() == [] and p.training_again_at(0.0) is None


def test_scenarios_resolve_and_unknown_names_are_refused() -> None:
    assert resolve(None, None, 100).name == "default"
    assert resolve("short", None, 100) is NAMED["short"]
    kinds = [s.kind for s in NAMED["default"].steps]
    assert kinds.count("notice") >= 2 and "rebalance" in kinds and "capacity-error" in kinds
    with pytest.raises(ValueError, match="unknown scenario 'nope'"):
        resolve("nope", None, 100)


def test_a_trace_becomes_one_notice_per_removal_simultaneous_ones_kept(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("0,add,n1\n0,add,n2\n0,add,n3\n600000,remove,n1\n600000,remove,n2\n1800000,remove,n3\n")
    sc = resolve(None, trace, 200)
    # Every removal is a notice; the two at one instant stay at one instant (a wave).
    assert [s.kind for s in sc.steps] == ["notice", "notice", "notice"]
    assert sc.steps[0].at_s == sc.steps[1].at_s == pytest.approx(30.0)
    assert sc.steps[2].at_s == pytest.approx(140.0)  # 20 minutes compressed into the run


def test_a_short_trace_plays_in_real_time_and_a_replacement_removal_targets_a_replacement(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        "0,add,n0\n0,add,n1\n0,add,n2\n0,add,n3\n"
        "40000,remove,n0\n40000,remove,n1\n45000,add,n4\n50000,remove,n4\n60000,remove,n2\n"
    )
    sc = resolve(None, trace, 200)
    assert [round(s.at_s - sc.steps[0].at_s, 3) for s in sc.steps] == [0.0, 0.0, 10.0, 20.0]
    assert [s.pick for s in sc.steps] == ["oldest", "oldest", "replacement", "oldest"]


def test_storm_scenario_is_a_wave_that_takes_the_whole_fleet() -> None:
    storm = resolve("storm", None, 100)
    assert storm.nodes == 4
    first = min(s.at_s for s in storm.steps)
    same_second = [s for s in storm.steps if s.at_s == first and s.kind == "notice"]
    assert len(same_second) == 2
    assert any(s.pick == "replacement" for s in storm.steps)
    (everyone,) = [s for s in storm.steps if s.kind == "notice-all"]
    # The whole wave within three minutes (compressed notice: the demo's minutes are shorter).
    assert everyone.at_s - first <= 180


def test_steps_redone_after_a_rollback_are_not_counted_twice(tmp_path: Path) -> None:
    recs = _steps(0.0, 2, 1, 40)
    recs += [{"ev": "start", "t": 9.0, "rank": 0, "world": 3, "from_step": 30}]  # 10 lost
    recs += _steps(9.5, 3, 31, 38)
    recs += [{"ev": "start", "t": 14.0, "rank": 0, "world": 4, "from_step": 38}]  # 0 lost
    recs += _steps(14.5, 4, 39, 45)
    restarts = Progress.load(_write(tmp_path / "ev.jsonl", recs)).restarts()
    assert [r.steps_lost for r in restarts] == [10, 0]


def test_a_stale_world_replaced_by_one_at_the_high_water_mark_loses_only_what_it_redid(tmp_path: Path) -> None:
    """A node restores an older durable copy (300) while the newest (334) is still uploading,
    trains one step alone, and is then replaced by a world that resumes at 334: 1 step redone,
    not 34 lost."""
    recs = _steps(0.0, 2, 1, 334, dt=0.01)
    recs += [{"ev": "start", "t": 9.0, "rank": 0, "world": 1, "from_step": 300}]
    recs += _steps(9.5, 1, 301, 301)
    recs += [{"ev": "start", "t": 20.0 + 0.01 * r, "rank": r, "world": 2, "from_step": 334} for r in range(2)]
    recs += _steps(20.5, 2, 335, 340)
    restarts = Progress.load(_write(tmp_path / "ev.jsonl", recs)).restarts()
    assert [r.steps_lost for r in restarts] == [1, 0]
    # Had the stale world been the last one, all 34 would be lost.
    (only,) = Progress.load(_write(tmp_path / "ev2.jsonl", recs[: -(2 + 12)])).restarts()
    assert only.steps_lost == 34


def _wave_run(stops: dict[str, float], durable_at: dict[int, float]) -> object:
    """The slice of a demo run `_whole_fleet` reads: a notice-all at t=10 on nodes a and b
    (127.0.0.1-2), their replacement c (127.0.0.3), wall clock == the loop's clock."""
    from types import SimpleNamespace

    addrs = {"a": "127.0.0.1", "b": "127.0.0.2", "c": "127.0.0.3"}
    nodes = {iid: SimpleNamespace(addr=addr, stopped_at=stops.get(iid)) for iid, addr in addrs.items()}
    return SimpleNamespace(
        injected=[(10.0, "notice-all", "*"), (10.0, "notice", "a"), (10.0, "notice", "b")],
        launcher=SimpleNamespace(nodes=nodes),
        view=SimpleNamespace(durable_at=durable_at),
        training_since=0.0,
        training_since_loop=0.0,
    )


def _start(t: float, node: str, from_step: int, world: int) -> dict:
    return {"ev": "start", "t": t, "node": node, "rank": 0, "world": world, "from_step": from_step}


def test_a_whole_fleet_wave_the_replacements_resume_from_the_notices_checkpoint(tmp_path: Path) -> None:
    from fleetd.demo.report import _whole_fleet

    recs = _steps(0.0, 2, 1, 100)  # the wave's hold at step 100 (t=9.9)
    recs += [_start(40.0, "127.0.0.3", 100, 1)] + _steps(40.5, 1, 101, 110)
    p = Progress.load(_write(tmp_path / "ev.jsonl", recs))
    wipe = _whole_fleet(_wave_run({"a": 20.0, "b": 25.0}, {100: 18.0}), p)
    assert wipe is not None
    assert (wipe["via"], wipe["resume_step"], wipe["last_step_before"], wipe["steps_lost"]) == (
        "checkpoint",
        100,
        100,
        0,
    )
    assert wipe["durable_step_before_last_left"] == 100 and wipe["last_left_s"] == 25.0


def test_the_replacements_own_saves_are_not_the_waves_though_a_noticed_node_outlasts_them(tmp_path: Path) -> None:
    """Run 30's timeline: the replacement resumed at the wave's 100 while b still drained its
    long notice, trained 101 and saved it for a joiner; b left after. The wave left 100 durable."""
    from fleetd.demo.report import _whole_fleet

    recs = _steps(0.0, 2, 1, 100)
    recs += [_start(40.0, "127.0.0.3", 100, 1)] + _steps(40.5, 1, 101, 110)
    p = Progress.load(_write(tmp_path / "ev.jsonl", recs))
    wipe = _whole_fleet(_wave_run({"a": 20.0, "b": 42.0}, {100: 18.0, 101: 40.6}), p)
    assert wipe is not None
    assert (wipe["via"], wipe["resume_step"], wipe["last_step_before"]) == ("checkpoint", 100, 100)
    assert wipe["durable_step_before_last_left"] == 100 and wipe["last_left_s"] == 42.0


def test_a_whole_fleet_wave_handed_to_replacements_that_joined_inside_the_notice(tmp_path: Path) -> None:
    """The replacement joined while both noticed nodes were still draining: one round with them
    (state from a peer), then they left. Nothing had to be durable first, and nothing was lost."""
    from fleetd.demo.report import _whole_fleet

    recs = _steps(0.0, 2, 1, 100)
    recs += [_start(15.0, a, 100, 3) for a in ("127.0.0.1", "127.0.0.2", "127.0.0.3")]
    recs += _steps(15.5, 3, 101, 101)
    recs += [_start(18.0, "127.0.0.3", 101, 1)] + _steps(18.5, 1, 102, 110)
    p = Progress.load(_write(tmp_path / "ev.jsonl", recs))
    wipe = _whole_fleet(_wave_run({"a": 17.0, "b": 17.5}, {}), p)
    assert wipe is not None
    assert (wipe["via"], wipe["resume_step"], wipe["last_step_before"], wipe["steps_lost"]) == ("peers", 100, 100, 0)
    assert wipe["durable_step_before_last_left"] is None


def test_a_whole_fleet_wave_counts_the_steps_the_replacements_did_not_carry_on_from(tmp_path: Path) -> None:
    from fleetd.demo.report import _whole_fleet

    recs = _steps(0.0, 2, 1, 120)  # trained past the durable 100 before the last left
    recs += [_start(40.0, "127.0.0.3", 100, 1)]
    p = Progress.load(_write(tmp_path / "ev.jsonl", recs))
    wipe = _whole_fleet(_wave_run({"a": 20.0, "b": 25.0}, {100: 18.0}), p)
    assert wipe is not None and (wipe["via"], wipe["steps_lost"]) == ("checkpoint", 20)
