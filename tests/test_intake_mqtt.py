"""Controller MQTT intake against the real mosquitto: valid agent messages reach the registry,
hostile ones are each logged exactly once and dropped, and the intake keeps running."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import aiomqtt
import pytest
from structlog.testing import capture_logs

from fleetd.intake.events import InterruptionNotice
from fleetd.intake.mqtt import MqttIntake
from fleetd.intake.registry import NodeRegistry
from fleetd.policy.model import Market, Node, PoolId
from fleetd.protocol.messages import CheckpointSaved, LeaveCommand, Notice, Status, Telemetry
from fleetd.protocol.topics import node_topic
from fleetd.shared.settings import MqttConfig

FLEET = "prod"


def notice(iid: str, **extra) -> dict:
    msg = Notice(instance_id=iid, action="terminate", action_time=datetime.now(UTC) + timedelta(minutes=2))
    return {**json.loads(msg.to_json()), **extra}


def hostile_messages(n: int) -> list[tuple[str, bytes]]:
    """n distinct (topic, payload) pairs, each on its own topic, cycling through the attacks."""

    def t(i: int, channel: str = "events", fleet: str = FLEET) -> str:
        return f"fleetd/{fleet}/nodes/h{i}/{channel}"

    attacks = [
        lambda i: (t(i), b'{"kind": "notice", "instance_id": '),  # truncated JSON
        lambda i: (t(i), b"\xff\xfe\x00binary"),  # not UTF-8
        lambda i: (t(i), b""),  # empty
        lambda i: (t(i), b"[1, 2, 3]"),  # JSON, not an object
        lambda i: (t(i, "events"), Telemetry(instance_id=f"h{i}").to_json()),  # wrong kind for channel
        lambda i: (t(i, "status"), json.dumps(notice(f"h{i}")).encode()),  # wrong kind for channel
        lambda i: (t(i), json.dumps(notice("i-someoneelse")).encode()),  # instance id mismatch
        lambda i: (t(i), json.dumps(notice(f"h{i}", pad="A" * 100_000)).encode()),  # huge
        lambda i: (t(i), json.dumps(notice(f"h{i}", evil=True)).encode()),  # unknown field
        lambda i: (t(i), json.dumps(notice(f"h{i}", schema_version=99)).encode()),  # future schema
        lambda i: (t(i), json.dumps(notice(f"h{i}", kind="rm-rf")).encode()),  # unknown kind
        lambda i: (t(i, fleet="other"), json.dumps(notice(f"h{i}")).encode()),  # other fleet
        lambda i: (t(i) + "/extra", json.dumps(notice(f"h{i}")).encode()),  # bad topic shape
        lambda i: (t(i, "secrets"), json.dumps(notice(f"h{i}")).encode()),  # unknown channel
        lambda i: (t(i), json.dumps(notice(f"h{i}", action_time="yesterday")).encode()),  # bad field
        lambda i: (t(i), json.dumps(notice(f"h{i}", msg_id="")).encode()),  # empty msg_id
    ]
    return [attacks[i % len(attacks)](i) for i in range(n)]


@pytest.fixture
def broker(mosquitto_factory):
    # A private broker: no retained messages from other tests reach the "fleetd/#" subscription.
    return mosquitto_factory().start()


@pytest.fixture
async def intake(broker):
    """An intake that subscribes to everything under fleetd/ (as if the broker did not filter)."""
    registry = NodeRegistry()
    intake = MqttIntake(
        MqttConfig(url=broker.url),
        FLEET,
        registry,
        subscriptions=("fleetd/#",),
        client_id=f"fleetd-test-{time.monotonic_ns()}",
    )
    task = asyncio.create_task(intake.run())
    await asyncio.wait_for(intake.connected.wait(), 10)
    yield intake
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def test_valid_messages_reach_the_registry(broker, intake: MqttIntake) -> None:
    registry = intake.registry
    async with aiomqtt.Client(broker.host, broker.port) as pub:
        iid = "i-0123456789abcdef0"
        status = Status(instance_id=iid, state="training", instance_type="g5.xlarge")
        await pub.publish(node_topic(FLEET, iid, "status"), status.to_json(), qos=1, retain=True)
        await pub.publish(
            node_topic(FLEET, iid, "telemetry"), Telemetry(instance_id=iid, step=42, steps_per_s=3.5).to_json()
        )
        n = Notice(instance_id=iid, action="terminate", action_time=datetime.now(UTC) + timedelta(minutes=2))
        for _ in range(3):  # QoS 1 redelivery: same msg_id three times
            await pub.publish(node_topic(FLEET, iid, "events"), n.to_json(), qos=1)
        saved = CheckpointSaved(instance_id=iid, step=40, world_size=2)
        await pub.publish(node_topic(FLEET, iid, "events"), saved.to_json(), qos=1)
        # A command echoed on the fleet's tree is not an event for the controller.
        await pub.publish(
            node_topic(FLEET, iid, "commands"), LeaveCommand(instance_id=iid, reason="x").to_json(), qos=1
        )
        await wait_for(lambda: registry.stats.by_type.get("TrainingEvent") == 1)

    rec = registry.record(iid)
    assert rec is not None
    assert rec.status is not None and rec.status.state == "training"
    assert rec.telemetry is not None and rec.telemetry.step == 42
    assert rec.notice_sources == {"imds"} and registry.stats.duplicates == 2
    assert isinstance(registry.drain_training_events()[0].message, CheckpointSaved)
    node = registry.observe(Node(iid, PoolId("g5.xlarge", "us-east-1a"), Market.SPOT, 0.5, launched_at=0.0))
    assert node.notice_at == rec.notice_at and node.step == 42 and node.steps_per_s == 3.5
    assert node.notice_deadline == pytest.approx(n.action_time.timestamp())
    assert intake.rejected == 0


async def test_1000_hostile_payloads_each_logged_once_and_intake_survives(broker, intake: MqttIntake) -> None:
    hostile = hostile_messages(1000)
    sentinel_id = "i-0000000000000beef"
    with capture_logs() as logs:
        async with aiomqtt.Client(broker.host, broker.port) as pub:
            for i, (topic, payload) in enumerate(hostile):
                await pub.publish(topic, payload, qos=1)
                if i % 100 == 0:  # valid traffic keeps flowing in between
                    await pub.publish(
                        node_topic(FLEET, f"i-{i:017x}", "telemetry"),
                        Telemetry(instance_id=f"i-{i:017x}").to_json(),
                        qos=1,
                    )
            sentinel = Notice(instance_id=sentinel_id, action="stop", action_time=datetime.now(UTC))
            await pub.publish(node_topic(FLEET, sentinel_id, "events"), sentinel.to_json(), qos=1)
            await wait_for(lambda: intake.registry.record(sentinel_id) is not None, 30)

    rejected = [e for e in logs if e["event"] == "intake_message_rejected"]
    assert Counter(e["topic"] for e in rejected) == Counter(topic for topic, _ in hostile)
    assert intake.rejected == 1000
    valid = [intake.registry.record(f"i-{i:017x}") for i in range(0, 1000, 100)]
    assert all(r is not None and r.telemetry is not None for r in valid)
    assert isinstance(intake.registry.record(sentinel_id).last_event, InterruptionNotice)
    # No hostile message created a node record.
    assert not any(r.instance_id.startswith("h") for r in intake.registry.records())
    assert all(len(e["preview"]) < 100 for e in rejected)  # huge payloads are not echoed into logs


async def test_send_command_reaches_the_node_topic(broker, intake: MqttIntake) -> None:
    iid = "i-0123456789abcdef0"
    async with aiomqtt.Client(broker.host, broker.port) as agent:
        await agent.subscribe(node_topic(FLEET, iid, "commands"), qos=1)
        cmd = LeaveCommand(instance_id=iid, reason="removed from rendezvous")
        await intake.send_command(cmd)
        async with asyncio.timeout(5):
            async for m in agent.messages:
                assert LeaveCommand.model_validate_json(m.payload) == cmd
                break


async def test_retained_status_is_dated_by_its_sent_at(broker) -> None:
    """After a controller restart the broker replays a dead node's last "ready": that must not
    count as a sign of life now (it would hide the silence signal)."""
    iid = "i-0000000000000dead"
    old = datetime.now(UTC) - timedelta(hours=1)
    async with aiomqtt.Client(broker.host, broker.port) as pub:
        status = Status(instance_id=iid, state="ready", sent_at=old)
        await pub.publish(node_topic(FLEET, iid, "status"), status.to_json(), qos=1, retain=True)
    registry = NodeRegistry()
    intake = MqttIntake(MqttConfig(url=broker.url), FLEET, registry, client_id="ctl-restarted")
    task = asyncio.create_task(intake.run())
    try:
        await wait_for(lambda: registry.record(iid) is not None)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert registry.record(iid).last_seen_at == pytest.approx(old.timestamp())


def _publish_from_thread(host: str, port: int, messages: list[tuple[str, bytes, int]]) -> None:
    """Publish with paho's own network thread and wait for the broker's acks: runs while the test
    holds the intake's event loop blocked."""
    import paho.mqtt.client as paho

    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"pub-{time.monotonic_ns()}")
    c.connect(host, port)
    c.loop_start()
    try:
        infos = [c.publish(topic, payload, qos=qos) for topic, payload, qos in messages]
        for info in infos:
            info.wait_for_publish(10)
    finally:
        c.disconnect()
        c.loop_stop()


async def test_telemetry_that_piles_up_is_coalesced_per_node_and_events_all_arrive_in_order(broker, intake) -> None:
    """The controller's loop is busy (blocked here) while 3 nodes send 40 samples each with
    notices and checkpoint receipts in between: once it reads again, each node's latest sample
    is what the registry holds, the older ones are counted superseded (not lost: accepted +
    superseded = sent), and every event is applied, in the order it was sent."""
    import threading

    nodes = [f"i-{k:017x}" for k in range(3)]
    messages: list[tuple[str, bytes, int]] = []
    sent_events: list[str] = []
    for step in range(1, 41):
        for iid in nodes:
            messages.append((node_topic(FLEET, iid, "telemetry"), Telemetry(instance_id=iid, step=step).to_json(), 0))
        if step % 10 == 0:
            iid = nodes[step // 10 % 3]
            ev = (
                CheckpointSaved(instance_id=iid, step=step, world_size=3)
                if step < 40
                else Notice(instance_id=iid, action="terminate", action_time=datetime.now(UTC) + timedelta(minutes=2))
            )
            sent_events.append(ev.msg_id)
            messages.append((node_topic(FLEET, iid, "events"), ev.to_json(), 1))
    applied: list[str] = []
    apply = intake.registry.apply

    def recording(event):
        if type(event).__name__ != "AgentTelemetry":
            applied.append(event.dedup_key)
        return apply(event)

    intake.registry.apply = recording
    publisher = threading.Thread(target=_publish_from_thread, args=(broker.host, broker.port, messages))
    publisher.start()
    publisher.join(30)  # blocks the loop: the intake reads nothing meanwhile
    time.sleep(0.5)  # the broker's deliveries reach the intake's socket
    teles = 40 * len(nodes)
    await wait_for(
        lambda: intake.accepted - len(sent_events) + intake.superseded >= teles and len(applied) == len(sent_events)
    )

    assert applied == sent_events
    assert intake.accepted - len(sent_events) + intake.superseded == teles
    assert intake.superseded > 0  # the samples that piled up were coalesced, not all applied
    for iid in nodes:
        rec = intake.registry.record(iid)
        assert rec is not None and rec.telemetry is not None and rec.telemetry.step == 40


def test_a_malformed_sample_superseded_in_the_inbox_is_still_rejected_and_logged() -> None:
    """Coalescing happens before validation: a bad message that a valid one replaces on its
    telemetry topic is rejected (counted and logged) all the same, never counted superseded."""
    import aiomqtt as _a

    intake = MqttIntake(MqttConfig(url="mqtt://127.0.0.1:1"), FLEET, NodeRegistry())
    inbox = intake._new_inbox()
    iid = "i-0123456789abcdef0"
    topic = node_topic(FLEET, iid, "telemetry")

    def msg(payload: bytes) -> _a.Message:
        return _a.Message(topic, payload, qos=0, retain=False, mid=0, properties=None)

    with capture_logs() as logs:
        inbox.put_nowait(msg(Telemetry(instance_id=iid, step=1).to_json()))
        inbox.put_nowait(msg(b'{"kind": "telemetry", "instance_id": '))  # truncated
        inbox.put_nowait(msg(Telemetry(instance_id=iid, step=3).to_json()))
    assert intake.superseded == 1 and intake.rejected == 1
    assert [e["event"] for e in logs] == ["intake_message_rejected"]
    last = inbox.get_nowait()
    assert intake.handle(str(last.topic), last.payload).telemetry.step == 3
