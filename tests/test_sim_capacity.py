"""Capacity discovery in the simulator is the same for every policy, and it is by trying.

EC2 has no "capacity came back" signal: CreateFleet / RunInstances answer
InsufficientInstanceCapacity and the caller tries again later. The world (fleetd/sim/engine.py)
therefore calls a policy's ``on_capacity`` one retry interval after a spot attempt that came back
short, never at the instant the trace adds capacity, and that interval is fleetd's own
capacity-error TTL (fleetd's planner waits exactly that long before it tries the pool again).
``capacity_signal="instant"`` keeps the old oracle as a sensitivity setting.
"""

from __future__ import annotations

import json

import pytest

from fleetd.config import CapacityConfig, FleetConfig, FleetdConfig
from fleetd.sim import defaults as d
from fleetd.sim.engine import INSTANT, PROBE, SimNode, World
from fleetd.sim.job import JobSpec
from fleetd.sim.policies import TorchrunElastic
from fleetd.sim.scenario import Scenario
from fleetd.sim.traces import read_availability_json

ADD_AT = 1000.0  # the trace's one spot node appears here (no capacity before it)


def _trace(counts, gap=100.0):
    return read_availability_json(json.dumps({"metadata": {"gap_seconds": gap}, "data": counts}), "count")


class _Recording(World):
    """The world, noting when each spot node was bought."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.spot_bought_at: list[float] = []

    def acquire_spot(self, count: int) -> list[SimNode]:
        got = super().acquire_spot(count)
        self.spot_bought_at += [self.now] * len(got)
        return got


def _first_spot(name: str, signal: str, ttl_s: float | None = None, nodes: int = 1) -> tuple[float, Scenario]:
    trace = _trace([0] * int(ADD_AT / 100) + [1] * 200)
    deadline = name in ("greedy", "uniform-progress")
    job = JobSpec(
        total_steps=3600.0 * nodes,
        max_nodes=nodes,
        scaling_efficiency_per_doubling=1.0,
        checkpoint_stall_s=0.0,
        no_notice_share=0.0,
        deadline_s=12 * 3600.0 if deadline else None,
    )
    base = None
    if ttl_s is not None:
        base = FleetdConfig(
            fleet=FleetConfig(), capacity=CapacityConfig(instance_types=("p3.2xlarge",), capacity_error_ttl_s=ttl_s)
        )
    sc = Scenario(
        trace,
        job,
        "p3.2xlarge",
        0.612,
        3.06,
        changeover_s=60.0,
        capacity_signal=signal,
        base_config=base,
        periodic_checkpoint_s=1800.0,
    )
    world = _Recording(
        trace,
        job,
        sc.spot_price,
        sc.on_demand_price,
        horizon_s=sc.horizon_s(),
        capacity_retry_s=sc.capacity_retry_s(),
        capacity_signal=signal,
    )
    world.run(sc.make_policy(name))
    assert world.spot_bought_at, f"{name} never bought spot"
    return world.spot_bought_at[0], sc


POLICIES = [("checkpoint-restart", 1), ("torchrun-default", 1), ("fleetd", 1), ("greedy", 1), ("greedy", 2)]


@pytest.mark.parametrize("name, nodes", POLICIES)
def test_a_short_policy_gets_spot_at_its_retry_not_when_capacity_appears(name, nodes) -> None:
    # Every policy tries at t = 0, finds nothing, and tries again every 600 s: the node that
    # appears at 1,000 s is found by the attempt at 1,200 s (fleetd's own pass runs a millisecond
    # after its capacity error's TTL ends).
    first, sc = _first_spot(name, PROBE, nodes=nodes)
    assert sc.capacity_retry_s() == 600.0
    assert first == pytest.approx(1200.0, abs=0.01)


@pytest.mark.parametrize("name, nodes", POLICIES)
def test_the_instant_signal_is_the_old_oracle_for_every_policy(name, nodes) -> None:
    first, _ = _first_spot(name, INSTANT, nodes=nodes)
    assert first == pytest.approx(ADD_AT, abs=0.01)


@pytest.mark.parametrize("name", ["torchrun-default", "fleetd", "greedy"])
def test_the_retry_interval_is_fleetds_capacity_error_ttl(name) -> None:
    # One number for both sides: an operator's TTL of 240 s makes every policy retry at 240 s
    # multiples (the node appearing at 1,000 s is found at 1,200 s = 5 x 240 s, not at 1,000 s).
    first, sc = _first_spot(name, PROBE, ttl_s=240.0)
    assert sc.capacity_retry_s() == sc.fleetd_config().capacity.capacity_error_ttl_s == 240.0
    assert first == pytest.approx(1200.0, abs=0.01)


def test_the_default_retry_is_the_daemons_config_default() -> None:
    assert d.CAPACITY_RETRY_S.value == CapacityConfig(instance_types=("p3.2xlarge",)).capacity_error_ttl_s
    assert "capacity_error_ttl_s" in d.CAPACITY_RETRY_S.source
    trace = _trace([1] * 10)
    sc = Scenario(trace, JobSpec(total_steps=10.0), "p3.2xlarge", 0.612, 3.06)
    assert sc.capacity_signal == PROBE and sc.capacity_retry_s() == d.CAPACITY_RETRY_S.value


def test_uniform_progress_on_one_node_buys_spot_at_its_own_attempt() -> None:
    # Idle and behind the line at the start, UP buys on-demand; when its hysteresis ends (after the
    # node appeared) it tries spot and finds it: an attempt of its own, the same with either signal
    # (while on on-demand it does not want spot, so the oracle tells it nothing it uses).
    first, _ = _first_spot("uniform-progress", PROBE)
    oracle, _ = _first_spot("uniform-progress", INSTANT)
    assert ADD_AT < first == pytest.approx(oracle)


def test_a_retry_that_finds_nothing_changes_nothing() -> None:
    # torchrun short of its size (1 of 2 nodes) retries every 600 s for 10 h and finds nothing:
    # no re-form, no rollback beyond the first formation.
    job = JobSpec(total_steps=1e9, max_nodes=2, scaling_efficiency_per_doubling=1.0, checkpoint_stall_s=0.0)
    world = World(_trace([1] * 360), job, 1.0, 3.0)
    r = world.run(TorchrunElastic(reform_s=40.0, periodic_checkpoint_s=1e9))
    assert world.capacity_retries == pytest.approx(36000 / 600, abs=1)
    assert r.overhead_node_s.get("re-form") == pytest.approx(40.0)
    assert r.steps_lost == 0


def test_one_retry_is_pending_at_a_time() -> None:
    class Eager:
        """Tries for spot on every callback and once a second besides."""

        name = "eager"

        def start(self, world: World) -> None:
            def tick() -> None:
                world.acquire_spot(1)
                world.after(1.0, tick)

            tick()

        def on_capacity(self, world: World) -> None:
            world.acquire_spot(1)

        def on_notice(self, world, node) -> None:
            pass

        def on_lost(self, world, node, noticed) -> None:
            pass

    job = JobSpec(total_steps=1e9)
    world = World(_trace([0] * 30), job, 1.0, 3.0, capacity_retry_s=600.0)
    world.run(Eager())
    assert world.capacity_retries == 5  # 600, 1200, ..., 3000 s: one each, not one per attempt


def test_bad_capacity_settings_are_rejected() -> None:
    job = JobSpec(total_steps=1.0)
    with pytest.raises(ValueError):
        World(_trace([1]), job, 1.0, 3.0, capacity_signal="psychic")
    with pytest.raises(ValueError):
        World(_trace([1]), job, 1.0, 3.0, capacity_retry_s=0.0)


def test_every_policy_in_a_comparison_gets_the_same_setting(capsys) -> None:
    from fleetd.cli import main

    assert main(["simulate", "--trace", "p3", "--policy", "torchrun-default", "--capacity-signal", "instant"]) == 0
    assert "capacity discovery, every policy: instant" in capsys.readouterr().out
    assert main(["simulate", "--trace", "p3", "--policy", "fleetd"]) == 0
    out = capsys.readouterr().out
    assert "capacity discovery, every policy: probe, retry 600 s" in out and "capacity_error_ttl_s" in out
