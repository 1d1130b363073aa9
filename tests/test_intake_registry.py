"""The node registry merges both intakes' events and feeds the planner's Node observations."""

from __future__ import annotations

from datetime import UTC, datetime

from fleetd.intake.events import (
    AgentStatus,
    AgentTelemetry,
    InstanceStateChanged,
    InterruptionNotice,
    RebalanceRecommended,
    from_message,
)
from fleetd.intake.registry import NodeRegistry
from fleetd.policy.lifecycle import assess
from fleetd.policy.model import Market, Node, PoolId
from fleetd.protocol.messages import Status, Telemetry

IID = "i-0123456789abcdef0"


def node(**kw) -> Node:
    return Node(IID, PoolId("g5.xlarge", "us-east-1a"), Market.SPOT, 0.4, launched_at=0.0, **kw)


def status(state: str) -> Status:
    return Status(instance_id=IID, state=state)


def test_duplicates_are_dropped_and_urgent_events_wake_the_loop() -> None:
    wakes: list[int] = []
    reg = NodeRegistry(wake=lambda: wakes.append(1))
    notice = InterruptionNotice(IID, "terminate", 1120.0, "imds", received_at=1000.0, dedup_key="m1")
    assert reg.apply(notice) is True
    assert reg.apply(notice) is False  # QoS 1 redelivery
    tele = from_message(Telemetry(instance_id=IID, step=3), 1001.0)
    assert reg.apply(tele) and reg.apply(tele)  # telemetry is never de-duplicated (QoS 0)
    assert reg.stats.duplicates == 1 and len(wakes) == 1  # telemetry does not wake the loop


def test_two_sources_merge_into_one_notice_with_both_sources() -> None:
    reg = NodeRegistry()
    reg.apply(InterruptionNotice(IID, "terminate", 1130.0, "eventbridge", received_at=1005.0, dedup_key="eb:1"))
    reg.apply(InterruptionNotice(IID, "terminate", 1121.0, "imds", received_at=1001.0, dedup_key="m1"))
    rec = reg.record(IID)
    assert rec.notice_sources == {"imds", "eventbridge"}
    assert rec.notice_at == 1005.0  # first seen
    assert rec.notice_deadline == 1121.0  # earliest deadline wins
    assert rec.last_seen_at == 1001.0  # only the agent's own message says it is alive


def test_observe_folds_intake_facts_into_the_planner_node() -> None:
    reg = NodeRegistry(clock=lambda: 955.0)
    reg.apply(AgentStatus(IID, status("training"), received_at=900.0, dedup_key="s1"))
    reg.apply(AgentTelemetry(IID, Telemetry(instance_id=IID, step=50, steps_per_s=4.0), received_at=950.0))
    reg.apply(RebalanceRecommended(IID, 940.0, "eventbridge", received_at=940.0, dedup_key="eb:2"))
    observed = reg.observe(node())
    assert observed.last_seen_at == 950.0 and observed.step == 50 and observed.steps_per_s == 4.0
    assert observed.rebalance_at == 940.0 and observed.notice_at is None
    # An EC2 event is news DescribeInstances may not show yet: the further state wins.
    reg.apply(InstanceStateChanged(IID, "shutting-down", received_at=960.0, dedup_key="eb:3"))
    assert reg.observe(node(ec2_state="running")).ec2_state == "shutting-down"
    assert reg.observe(node(ec2_state="terminated")).ec2_state == "terminated"
    assert reg.observe(Node("i-unknown", PoolId("a", "b"), Market.SPOT, 1.0, 0.0)).last_seen_at is None


def test_registry_feeds_the_two_signal_rule() -> None:
    reg = NodeRegistry()
    reg.apply(AgentStatus(IID, status("training"), received_at=1000.0, dedup_key="s1"))
    reg.apply(InterruptionNotice(IID, "terminate", 1120.0, "eventbridge", received_at=1001.0, dedup_key="eb:1"))
    one = assess(reg.observe(node()), now=1002.0, silence_s=30.0)
    assert not one.lost  # a notice alone: the node is draining, not lost
    # The last will arrives (status offline): while the notice runs, the node is left to its
    # notice flow (the notice says it will go, not that it has: policy/lifecycle.py).
    reg.apply(from_message(Status(instance_id=IID, state="offline", sent_at=datetime.now(UTC)), 1003.0))
    during = assess(reg.observe(node()), now=1004.0, silence_s=30.0)
    assert not during.lost and len(during.signals) == 1
    # Past the notice's deadline the notice and the broker (last will, silence) are two sources.
    two = assess(reg.observe(node()), now=1121.0, silence_s=30.0)
    assert two.lost and "from 2 independent sources" in two.reason


def test_trainer_exited_after_a_drain_marks_the_node_left_for_the_planner() -> None:
    from fleetd.config import FleetdConfig
    from fleetd.policy.model import NodePhase, Terminate
    from fleetd.policy.observation import Observation
    from fleetd.policy.planner import plan
    from fleetd.protocol.messages import TrainerExited

    reg = NodeRegistry()
    reg.apply(AgentStatus(IID, status("training"), received_at=900.0, dedup_key="s1"))
    # A crash before any drain (the supervisor restarts torchrun) is not a departure.
    reg.apply(from_message(TrainerExited(instance_id=IID, exit_code=1, reason="worker crashed"), 950.0))
    early = reg.observe(node(phase=NodePhase.DRAINING, drain_started_at=1000.0))
    assert early.left_at == 950.0 and not early.has_left
    # After the drain: the agent's trainer-exited report, with its reason.
    reg.apply(from_message(TrainerExited(instance_id=IID, exit_code=0, reason="left the rendezvous"), 1012.0))
    assert reg.record(IID).exit_reason == "left the rendezvous"
    drained = reg.observe(node(phase=NodePhase.DRAINING, drain_started_at=1000.0, last_seen_at=1012.0))
    assert drained.left_at == 1012.0 and drained.has_left
    cfg = FleetdConfig(fleet={"min_nodes": 0, "max_nodes": 1})
    (term,) = plan(Observation(nodes=(drained,), target_nodes=0), cfg, 1015.0).actions
    assert isinstance(term, Terminate) and term.instance_id == IID
    assert term.reason == (
        f"{IID} has left the rendezvous (trainer exited 3 s ago, after its drain): terminating it so it stops billing"
    )


def test_status_leaving_counts_as_left_and_the_latest_report_wins() -> None:
    reg = NodeRegistry()
    reg.apply(AgentStatus(IID, status("draining"), received_at=1000.0, dedup_key="s1"))
    assert reg.observe(node()).left_at is None
    reg.apply(AgentStatus(IID, status("leaving"), received_at=1009.0, dedup_key="s2"))
    assert reg.observe(node()).left_at == 1009.0
    assert reg.observe(node(left_at=1020.0)).left_at == 1020.0  # the later of the two
    assert reg.observe(node(notice_at=1001.0)).has_left  # after its notice


def test_one_slow_report_is_not_a_straggler_a_sustained_slowdown_is() -> None:
    """Stragglers are judged on the reports' average: replacing a node costs every rank a re-form,
    so a single slow sample (a GC pause, a data-loader hiccup) must not trigger it."""
    from fleetd.policy.model import NodePhase
    from fleetd.policy.scaling import stragglers

    peers = [
        Node(
            f"i-{k}",
            PoolId("g5.xlarge", "us-east-1a"),
            Market.SPOT,
            0.4,
            launched_at=0.0,
            phase=NodePhase.RUNNING,
            steps_per_s=1.0,
            steps_per_s_avg=1.0,
        )
        for k in range(3)
    ]
    clock = [0.0]
    reg = NodeRegistry(clock=lambda: clock[0])

    def report(rate: float) -> Node:
        clock[0] += 1.0
        reg.apply(
            AgentTelemetry(IID, Telemetry(instance_id=IID, step=int(clock[0]), steps_per_s=rate), received_at=clock[0])
        )
        return reg.observe(node(phase=NodePhase.RUNNING))

    for _ in range(10):
        report(1.0)
    hiccup = report(0.1)
    assert hiccup.steps_per_s == 0.1 and hiccup.steps_per_s_avg is not None and hiccup.steps_per_s_avg > 0.8
    assert stragglers([*peers, hiccup], 0.5, now=1000.0, settle_s=120.0) == []
    for _ in range(15):
        slow = report(0.2)
    (found,) = stragglers([*peers, slow], 0.5, now=1000.0, settle_s=120.0)
    assert found[0].instance_id == IID and "averaged over its reports" in found[1]
