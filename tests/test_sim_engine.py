"""The discrete-event engine's books, checked against hand-computed runs."""

from __future__ import annotations

import json

import pytest

from fleetd.sim.clock import EventQueue
from fleetd.sim.engine import SimNode, World, simulate
from fleetd.sim.job import JobSpec
from fleetd.sim.policies import OnDemandOnly, TorchrunElastic
from fleetd.sim.traces import read_availability_json


def _count_trace(counts, gap=100.0):
    return read_availability_json(json.dumps({"metadata": {"gap_seconds": gap}, "data": counts}), "count")


def _job(**kw):
    base = dict(total_steps=1e9, scaling_efficiency_per_doubling=1.0, max_nodes=2, checkpoint_stall_s=0.0)
    base.update(kw)
    return JobSpec(**base)


def test_event_queue_orders_by_time_then_priority_and_skips_cancelled():
    q = EventQueue()
    seen = []
    q.at(5.0, lambda: seen.append("b"), priority=2)
    q.at(5.0, lambda: seen.append("a"), priority=0)
    q.at(1.0, lambda: seen.append("first"))
    q.at(3.0, lambda: seen.append("never")).cancel()
    while (fn := q.pop_until(10.0)) is not None:
        fn()
    assert seen == ["first", "a", "b"]
    assert q.now == 5.0


def test_on_demand_run_costs_exactly_its_node_time():
    job = _job(total_steps=7200.0, periodic_checkpoint_s=10_000.0)
    r = simulate(_count_trace([0] * 50), OnDemandOnly(2, 10_000.0), job, spot_price=1.0, on_demand_price=3.6)
    assert r.completed and r.finished_at_s == pytest.approx(3600.0)
    assert r.paid_node_s == pytest.approx(7200.0)
    assert r.cost_usd == pytest.approx(2 * 3.6)
    assert r.on_demand_cost_usd == pytest.approx(r.cost_usd)
    assert r.effective_time == pytest.approx(1.0)
    assert r.steps_lost == 0


def test_torchrun_loses_work_since_its_last_checkpoint_by_hand():
    # Two spot nodes; one is reclaimed at t=1000 s; the trace ends at 2000 s.
    trace = _count_trace([2] * 10 + [1] * 10)
    job = _job(no_notice_share=0.0)
    r = simulate(trace, TorchrunElastic(reform_s=40.0, periodic_checkpoint_s=300.0), job, 1.0, 3.0)
    # Training from 40 s at 2 steps/s; checkpoints at 300/600/900 s; at 1000 s progress is
    # 1920, it resumes from 1720 (lost 200) and re-forms for 40 s with one node until 2000 s.
    assert r.steps_lost == pytest.approx(200.0)
    assert r.steps_done == pytest.approx(1720.0 + 960.0)
    assert r.paid_node_s == pytest.approx(3000.0)
    assert r.useful_node_s == pytest.approx(2680.0)
    assert r.overhead_node_s == pytest.approx({"re-form": 120.0, "lost work": 200.0})
    assert r.cost_usd == pytest.approx(3000.0 / 3600.0)
    assert r.notices == 1  # the notice was sent; torchrun just does not listen


def test_books_balance_paid_equals_useful_plus_overheads():
    trace = _count_trace([2, 2, 1, 0, 2, 1, 2, 2, 0, 1, 2] * 4, gap=300)
    job = _job(checkpoint_stall_s=5.0, no_notice_share=0.3)
    r = simulate(trace, TorchrunElastic(reform_s=40.0, periodic_checkpoint_s=250.0), job, 1.0, 3.0, seed=4)
    assert r.useful_node_s + sum(r.overhead_node_s.values()) == pytest.approx(r.paid_node_s)
    assert 0 < r.effective_time < 1


class _Recorder:
    name = "recorder"

    def __init__(self):
        self.notices: list[tuple[float, str]] = []
        self.lost: list[tuple[float, str, bool]] = []

    def start(self, world: World) -> None:
        world.set_members(world.acquire_spot(world.job.max_nodes))

    def on_capacity(self, world: World) -> None:
        world.set_members(world.members() + world.acquire_spot(1))

    def on_notice(self, world: World, node: SimNode) -> None:
        self.notices.append((world.now, node.id))

    def on_lost(self, world: World, node: SimNode, noticed: bool) -> None:
        self.lost.append((world.now, node.id, noticed))


@pytest.mark.parametrize("share, noticed", [(0.0, True), (1.0, False)])
def test_notices_come_lead_seconds_ahead_unless_unannounced(share, noticed):
    trace = _count_trace([1] * 10 + [0] * 5)
    rec = _Recorder()
    simulate(trace, rec, _job(max_nodes=1, no_notice_share=share, notice_lead_s=120.0), 1.0, 3.0)
    assert rec.lost == [(1000.0, rec.lost[0][1], noticed)]
    assert rec.notices == ([(880.0, rec.lost[0][1])] if noticed else [])


def test_which_losses_are_unannounced_depends_on_seed_only():
    trace = _count_trace([3, 2, 3, 1, 3, 0, 3, 2, 3, 1, 3] * 6)
    job = _job(max_nodes=3, no_notice_share=0.5)
    runs = [simulate(trace, _Recorder(), job, 1.0, 3.0, seed=s) for s in (1, 1, 2)]
    assert runs[0].losses_without_notice == runs[1].losses_without_notice
    assert 0 < runs[0].losses_without_notice < runs[0].notices + runs[0].losses_without_notice


def test_a_node_released_early_pays_the_60s_minimum():
    class Brief(_Recorder):
        def start(self, world):
            node = world.acquire_on_demand(1)[0]
            world.after(10.0, lambda: world.release(node))

    r = simulate(_count_trace([0] * 5), Brief(), _job(), 1.0, 3.6)
    assert r.paid_node_s == pytest.approx(60.0)
    assert r.cost_usd == pytest.approx(0.06)
    assert r.overhead_node_s["minimum charge"] == pytest.approx(50.0)


def test_job_model_scaling_and_units():
    job = JobSpec.from_gpu_hours(8.0, gpus_per_node=4, steps_per_node_s=2.0, scaling_efficiency_per_doubling=0.9)
    assert job.total_steps == pytest.approx(2 * 3600 * 2.0)
    assert job.throughput(1) == 2.0
    assert job.throughput(4) == pytest.approx(4 * 2.0 * 0.81)
    with pytest.raises(ValueError):
        JobSpec(total_steps=0)
    with pytest.raises(ValueError):
        JobSpec(total_steps=1, min_nodes=3, max_nodes=2)


def test_measured_bench_results_replace_design_figures(tmp_path):
    from fleetd.sim.defaults import FLEETD_JOIN_REFORM_S, FLEETD_REFORM_S, measured_overrides

    assert measured_overrides(tmp_path) == {}
    (tmp_path / "rebalance.json").write_text(
        json.dumps(
            {
                "notice_to_training_s": 2.4,
                "join_to_training_s": 4.4,  # the newcomer's whole start-up: not the running ranks' pause
                "join_pause_s": 1.1,
                "default_notice_to_training_s": 41.0,
                "steps_lost": 0,
            }
        )
    )
    found = measured_overrides(tmp_path)
    assert found["reform_s"].value == 2.4 and "bench/rebalance.py" in found["reform_s"].source
    assert found["join_reform_s"].value == 1.1
    assert found["torchrun_reform_s"].value == 41.0
    (tmp_path / "rebalance.json").write_text("not json")
    assert measured_overrides(tmp_path) == {}
    # The defaults are measurements too, and say which.
    for figure in (FLEETD_REFORM_S, FLEETD_JOIN_REFORM_S):
        assert "measured" in figure.source and "bench/rebalance.py" in figure.source
