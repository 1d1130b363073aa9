"""Scaling from what the nodes report: throughput per world size measured from real progress
(fleetd/intake/signals.py), smoothed GPU utilisation (registry), and the rule deciding on
throughput alone where no GPU telemetry exists (the demo's CPU nodes)."""

from __future__ import annotations

from fleetd.intake.events import AgentTelemetry
from fleetd.intake.registry import NodeRegistry
from fleetd.intake.signals import MIN_WINDOW_S, TrainingSignals
from fleetd.policy.model import Drain, Launch, NodePhase
from fleetd.policy.observation import Observation
from fleetd.policy.planner import plan
from fleetd.policy.scaling import node_flag
from fleetd.protocol.messages import GpuSample, Telemetry
from tests.policy_fixtures import NOW, A, B, config, node, offer

CFG = config(
    fleet={"min_nodes": 1, "max_nodes": 4},
    scaling={"min_marginal_efficiency": 0.7, "efficiency_hysteresis": 0.1, "cooldown_s": 20.0},
    budget={"total_usd": 1000.0, "max_usd_per_hour": 100.0},
)
OFFERS = (offer(A, 0.4), offer(B, 0.4))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _report(
    reg: NodeRegistry, clock: Clock, iid: str, step: int, world: int, util: float | None = None, cpu: float = 10.0
) -> None:
    gpus = (GpuSample(index=0, util_pct=util, mem_used_mib=1, mem_total_mib=2),) if util is not None else ()
    tel = Telemetry(instance_id=iid, step=step, steps_per_s=99.0, world_size=world, gpus=gpus, cpu_pct=cpu)
    reg.apply(AgentTelemetry(iid, tel, received_at=clock.t))


def test_throughput_per_size_is_measured_from_progress_after_the_reform_pause() -> None:
    clock, reg = Clock(), NodeRegistry()
    sig = TrainingSignals(reg, clock=clock)
    step = 0
    for _ in range(int(MIN_WINDOW_S) + 2):  # one node: 2 steps/s (the trainer's own rate field says 99: ignored)
        clock.t += 1.0
        step += 2
        _report(reg, clock, "a", step, 1)
        rates = sig.snapshot().throughput_by_nodes
    assert rates == {1: 2.0}
    clock.t += 30.0  # re-form pause: nothing reported, then two nodes at 5 steps/s
    for _ in range(int(MIN_WINDOW_S) + 2):
        clock.t += 1.0
        step += 5
        _report(reg, clock, "a", step, 2)
        _report(reg, clock, "b", step, 2)
        rates = sig.snapshot().throughput_by_nodes
    assert rates == {1: 2.0, 2: 5.0}  # the pause before the first report at 2 nodes is not counted


def test_a_pass_that_runs_late_does_not_inflate_the_measured_rate() -> None:
    # A loaded control host runs the reconcile pass seconds after the telemetry it reads arrived.
    # The window is timed by the reports' arrivals, so 3.3 steps/s stays 3.3 steps/s (timed by
    # the passes, a first pass 6 s late made it 4.7: a node that added nothing looked worth its price).
    arrivals, passes, reg = Clock(), Clock(), NodeRegistry()
    sig = TrainingSignals(reg, clock=passes)
    rate = 10 / 3
    for i in range(1, 41):
        arrivals.t += 1.0
        _report(reg, arrivals, "a", int(i * rate), 2)
        _report(reg, arrivals, "b", int(i * rate), 2)
        passes.t = arrivals.t + (6.0 if i == 1 else 0.0)
        if i == 1 or i % 2 == 0:
            sig.snapshot()
    measured = sig.snapshot().throughput_by_nodes[2]
    assert abs(measured - rate) < 0.1, measured


def test_cpu_nodes_scale_on_throughput_alone() -> None:
    def fleet(n: int):
        return tuple(node(f"i-{k}", (A, B)[k % 2], util=None) for k in range(n))

    def obs(n: int, rates: dict) -> Observation:
        return Observation(
            nodes=fleet(n), offers=OFFERS, throughput_by_nodes=rates, target_nodes=n, last_scaling_at=NOW - 100
        )

    up = plan(obs(1, {1: 2.5}), CFG, NOW)
    assert up.target_nodes == 2 and [a.count for a in up.of_type(Launch)] == [1]
    assert "no GPU telemetry" in up.target_reason and "exploring" in up.target_reason
    grow = plan(obs(2, {1: 2.5, 2: 5.0}), CFG, NOW)
    assert grow.target_nodes == 3, grow.target_reason
    shrink = plan(obs(3, {1: 2.5, 2: 5.0, 3: 5.05}), CFG, NOW)
    assert shrink.target_nodes == 2 and len(shrink.of_type(Drain)) == 1
    assert "node 3 adds 0.050 steps/s" in shrink.target_reason
    hold = plan(obs(2, {1: 2.5, 2: 5.0, 3: 5.05}), CFG, NOW)
    assert hold.target_nodes == 2 and "node 3 would add 0.050 steps/s (measured at 3 nodes)" in hold.target_reason
    unmeasured = plan(obs(2, {1: 2.5}), CFG, NOW)
    assert unmeasured.target_nodes == 2 and "not measured yet" in unmeasured.target_reason


def test_gpu_utilisation_is_smoothed_and_idle_or_input_bound_nodes_are_named() -> None:
    clock = Clock()
    reg = NodeRegistry(clock=clock)  # telemetry counts only while fresh on the registry's clock
    for _ in range(30):
        clock.t += 1.0
        _report(reg, clock, "a", 1, 1, util=90.0)
    _report(reg, clock, "a", 1, 1, util=0.0)  # one bad sample does not make it idle
    seen = reg.observe(node("a", util=None))
    assert seen.gpu_util_pct > 75.0
    for _ in range(60):
        clock.t += 1.0
        _report(reg, clock, "a", 1, 1, util=5.0, cpu=98.0)
        _report(reg, clock, "b", 1, 1, util=5.0, cpu=10.0)
    assert node_flag(reg.observe(node("a", util=None)), CFG).startswith("input-bound: GPU 5%")
    assert node_flag(reg.observe(node("b", util=None)), CFG).startswith("gpu-idle: GPU 5%")
    assert node_flag(node("c", util=None), CFG) is None  # no NVML: nothing measured, nothing said
    assert node_flag(node("d", util=95.0, phase=NodePhase.RUNNING), CFG) is None
