"""Independent second signals (issue 16 item 2): a node is lost only when two sources that cannot
share a fault agree. Pure: plain nodes and ``now`` in, verdicts out."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fleetd.intake.events import AgentStatus
from fleetd.intake.registry import NodeRegistry
from fleetd.policy.lifecycle import Signal, Source, assess, split_lost
from fleetd.policy.model import Terminate
from fleetd.policy.observation import Observation
from fleetd.policy.planner import plan
from fleetd.protocol.messages import Status
from tests.policy_fixtures import NOW, A, B, config, node, offer

SILENCE_S, STORE_S = 30.0, 30.0
QUIET = NOW - 120


def cut_from_broker(iid: str, **kw):
    """Silent on MQTT and its last will delivered: both from the one broker connection."""
    return node(iid, seen=QUIET, agent_offline_at=QUIET + 20, **kw)


def test_broker_silence_and_last_will_are_one_source():
    v = assess(cut_from_broker("i-1", store_seen_at=NOW - 1), NOW, SILENCE_S, STORE_S)
    assert not v.lost and v.signals == (Signal.SILENCE, Signal.LAST_WILL)
    assert "one source only" in v.reason and "broker connection" in v.reason


def test_store_silence_alone_is_one_source():
    v = assess(node("i-1", store_seen_at=NOW - 60), NOW, SILENCE_S, STORE_S)
    assert not v.lost and v.signals == (Signal.STORE_SILENCE,)


def test_broker_plus_store_is_lost_while_another_node_reaches_both():
    cut = cut_from_broker("i-1", store_seen_at=NOW - 60)
    healthy = node("i-2", store_seen_at=NOW - 1)
    lost, alive = split_lost((cut, healthy), NOW, SILENCE_S, STORE_S)
    assert [v.node.instance_id for v in lost] == ["i-1"] and [n.instance_id for n in alive] == ["i-2"]
    assert "from 2 independent sources" in lost[0].reason


def test_everyone_quiet_on_both_is_the_control_hosts_network_not_the_nodes():
    nodes = tuple(cut_from_broker(f"i-{k}", store_seen_at=NOW - 60) for k in range(3))
    lost, alive = split_lost(nodes, NOW, SILENCE_S, STORE_S)
    assert lost == [] and len(alive) == 3
    # ... but EC2's word still counts as the independent second source.
    stopped = cut_from_broker("i-9", store_seen_at=NOW - 60, ec2_state="stopped")
    lost, _ = split_lost((*nodes, stopped), NOW, SILENCE_S, STORE_S)
    assert [v.node.instance_id for v in lost] == ["i-9"]


def test_broker_plus_ec2_and_store_plus_ec2_are_lost():
    assert assess(cut_from_broker("i-1", ec2_state="stopping"), NOW, SILENCE_S, STORE_S).lost
    assert assess(node("i-1", store_seen_at=NOW - 60, ec2_state="stopped"), NOW, SILENCE_S, STORE_S).lost


def test_without_store_threshold_the_store_is_not_weighed():
    v = assess(cut_from_broker("i-1", store_seen_at=NOW - 600), NOW, SILENCE_S, None)
    assert not v.lost and Signal.STORE_SILENCE not in v.signals


def test_a_node_never_heard_on_the_store_is_not_store_silent():
    v = assess(cut_from_broker("i-1", store_seen_at=None), NOW, SILENCE_S, STORE_S)
    assert not v.lost


def test_planner_keeps_a_node_cut_from_the_broker_that_answers_the_store():
    cfg = config(fleet={"min_nodes": 1, "max_nodes": 2}, rebalance={"silence_s": SILENCE_S})
    nodes = (cut_from_broker("i-1", store_seen_at=NOW - 1), node("i-2", store_seen_at=NOW - 1))
    obs = Observation(nodes=nodes, offers=(offer(A, 0.4), offer(B, 0.5)), target_nodes=2, last_scaling_at=NOW)
    assert not plan(obs, cfg, NOW).of_type(Terminate)
    both = (cut_from_broker("i-1", store_seen_at=NOW - 60), node("i-2", store_seen_at=NOW - 1))
    obs = Observation(nodes=both, offers=(offer(A, 0.4), offer(B, 0.5)), target_nodes=2, last_scaling_at=NOW)
    (term,) = plan(obs, cfg, NOW).of_type(Terminate)
    assert term.instance_id == "i-1" and "rendezvous heartbeat silence" in term.reason


_sources = st.sets(st.sampled_from(list(Signal)))


@given(present=_sources)
def test_lost_iff_two_sources(present):
    """Property: whatever the mix, lost == at least two distinct sources (no terminal state)."""
    fields: dict = {"store_seen_at": NOW - 1}
    if Signal.NOTICE in present:
        fields["notice_at"] = NOW - 5
    if Signal.SILENCE in present:
        fields["seen"] = QUIET
    if Signal.LAST_WILL in present:
        fields["agent_offline_at"] = NOW
        fields.setdefault("seen", NOW - 2)
    if Signal.STATE_CHANGE in present:
        fields["ec2_state"] = "stopping"
    if Signal.STORE_SILENCE in present:
        fields["store_seen_at"] = NOW - 60
    v = assess(node("i-1", **fields), NOW, SILENCE_S, STORE_S)
    from fleetd.policy.lifecycle import SOURCE

    assert set(v.signals) == present
    assert v.lost == (len({SOURCE[s] for s in present}) >= 2)
    assert Source.BROKER.value == "broker connection"


def test_registry_maps_store_heartbeats_to_the_instance_by_its_address():
    reg = NodeRegistry(clock=lambda: NOW)
    reg.note_store_heartbeat("10.0.0.5", NOW - 3)  # unknown address: ignored
    reg.apply(
        AgentStatus(
            instance_id="i-0123456789abcdef0",
            received_at=NOW - 10,
            dedup_key="s1",
            status=Status(instance_id="i-0123456789abcdef0", state="ready", node_addr="10.0.0.5"),
        )
    )
    reg.note_store_heartbeat("10.0.0.5", NOW - 2)
    reg.note_store_heartbeat("10.0.0.5", NOW - 4)  # older news never moves it back
    assert reg.record("i-0123456789abcdef0").store_seen_at == NOW - 2
    assert reg.observe(node("i-0123456789abcdef0")).store_seen_at == NOW - 2


def test_stale_telemetry_rates_are_not_folded_so_a_cut_node_is_no_straggler():
    from fleetd.intake.events import AgentTelemetry
    from fleetd.protocol.messages import Telemetry

    iid = "i-0123456789abcdef0"
    clock = [NOW]
    reg = NodeRegistry(clock=lambda: clock[0])
    reg.apply(AgentTelemetry(iid, Telemetry(instance_id=iid, step=50, steps_per_s=0.5), received_at=NOW))
    assert reg.observe(node(iid, sps=None)).steps_per_s == 0.5
    clock[0] = NOW + 60  # cut from the broker for a minute: its last report says nothing now
    seen = reg.observe(node(iid, sps=None, util=None))
    assert seen.steps_per_s is None and seen.gpu_util_pct is None and seen.step == 50
