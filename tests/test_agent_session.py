"""The whole agent in-process against the fake IMDS and the real mosquitto."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import aiomqtt
import pytest

from agent.config import AgentConfig, NodeConfig
from agent.doubles.fake_imds import FakeImds
from agent.hooks import AgentContext, LoggingHooks
from agent.main import Agent
from agent.node.imds import IDENTITY_PATHS
from fleetd.demo.configs import trainer_socket_for
from fleetd.protocol.messages import (
    CheckpointCommand,
    LeaveCommand,
    Notice,
    ShutdownCommand,
    Status,
    Telemetry,
    parse_message,
)
from fleetd.protocol.topics import node_topic
from fleetd.protocol.trainer import CheckpointSavedLocally, Progress, send_report
from fleetd.shared.settings import MqttConfig

FLEET = "agenttest"


class RecordingHooks(LoggingHooks):
    """Records what the agent asked of the emergency path, with the time it was asked."""

    instances: list[RecordingHooks] = []

    def __init__(self, ctx: AgentContext) -> None:
        super().__init__(ctx)
        self.calls: list[tuple[str, object, float]] = []
        self.stopped = False
        RecordingHooks.instances.append(self)

    async def on_notice(self, notice):
        self.calls.append(("notice", notice, time.time()))

    async def on_checkpoint(self, command):
        self.calls.append(("checkpoint", command, time.time()))

    async def on_leave(self, command):
        self.calls.append(("leave", command, time.time()))

    async def on_checkpoint_saved(self, report):
        self.calls.append(("checkpoint_saved", report, time.time()))

    async def on_shutdown(self, command):
        self.calls.append(("shutdown", command, time.time()))

    async def stop(self):
        self.stopped = True


def agent_config(imds_url: str, mqtt_url: str, state_dir: Path, **node: object) -> AgentConfig:
    return AgentConfig(
        node=NodeConfig(
            fleet=FLEET,
            imds_url=imds_url,
            state_dir=state_dir,
            trainer_socket=trainer_socket_for(state_dir),
            poll_interval_s=0.25,
            telemetry_interval_s=0.2,
            shutdown_timeout_s=5,
            **node,
        ),
        mqtt=MqttConfig(url=mqtt_url, keepalive_s=5),
    )


@pytest.fixture
def state_dir():
    # Short path: unix socket paths are limited to ~107 bytes.
    with tempfile.TemporaryDirectory(prefix="fa-", dir="/tmp") as d:
        yield Path(d)


async def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def test_notice_is_published_within_1_5_s_through_imds_faults(mosquitto, state_dir) -> None:
    iid = "i-00000000000000a01"
    RecordingHooks.instances.clear()
    async with FakeImds(instance_id=iid) as fake, aiomqtt.Client(mosquitto.host, mosquitto.port) as sub:
        fake.timeout_fault_s = 2.0
        await sub.subscribe(f"fleetd/{FLEET}/nodes/{iid}/+", qos=1)
        agent = Agent(agent_config(fake.url, mosquitto.url, state_dir, imds_timeout_s=0.5), RecordingHooks)
        task = asyncio.create_task(agent.run())
        received: list[tuple[str, object, float]] = []

        async def collect() -> None:
            async for m in sub.messages:
                received.append((str(m.topic).rsplit("/", 1)[1], parse_message(m.payload), time.time()))

        collector = asyncio.create_task(collect())
        await wait_until(lambda: any(isinstance(msg, Status) and msg.state == "ready" for _, msg, _ in received))
        # Everything IMDS can do wrong, while the agent runs.
        fake.expire_tokens()
        await asyncio.sleep(0.6)
        for kind in ("500", "timeout", "garbage", "401"):
            fake.inject(kind, count=2, path_prefix="/latest/meta-data/spot/")
            await asyncio.sleep(0.6)
        visible_at = fake.schedule_notice(in_s=0.3)
        await wait_until(lambda: any(ch == "events" for ch, _, _ in received), 5)
        await asyncio.sleep(1.0)  # later polls must not publish the same notice again

        agent.request_stop()
        await asyncio.wait_for(task, 10)
        await wait_until(lambda: any(isinstance(m, Status) and m.state == "offline" for _, m, _ in received), 5)
        collector.cancel()

    events = [(msg, at) for ch, msg, at in received if ch == "events"]
    assert len(events) == 1
    notice, published_at = events[0]
    assert isinstance(notice, Notice) and notice.source == "imds" and notice.instance_id == iid
    latency = published_at - visible_at
    assert latency < 1.5, f"notice took {latency:.2f}s from IMDS to the broker"
    hooks = RecordingHooks.instances[-1]
    assert [c[0] for c in hooks.calls] == ["notice"] and hooks.calls[0][1] == notice
    assert hooks.stopped
    for path in IDENTITY_PATHS.values():
        assert fake.requests[path] == 1, f"identity path {path} read {fake.requests[path]} times"
    assert fake.rejected_401 >= 1  # the forced expiry was seen, and survived
    statuses = [m for ch, m, _ in received if ch == "status"]
    assert statuses[0].state == "ready" and statuses[0].instance_type == "g5.xlarge"
    assert statuses[-1].state == "offline"


async def test_commands_trainer_reports_and_telemetry(mosquitto, state_dir) -> None:
    iid = "i-00000000000000a02"
    RecordingHooks.instances.clear()
    async with FakeImds(instance_id=iid) as fake, aiomqtt.Client(mosquitto.host, mosquitto.port) as ctl:
        await ctl.subscribe(f"fleetd/{FLEET}/nodes/{iid}/+", qos=1)
        agent = Agent(agent_config(fake.url, mosquitto.url, state_dir), RecordingHooks)
        task = asyncio.create_task(agent.run())
        received: list[tuple[str, object]] = []

        async def collect() -> None:
            async for m in ctl.messages:
                if str(m.topic).endswith("/commands"):
                    continue  # our own commands, garbage included
                received.append((str(m.topic).rsplit("/", 1)[1], parse_message(m.payload)))

        collector = asyncio.create_task(collect())
        await wait_until(lambda: agent.session is not None and agent.session.connected.is_set())
        hooks = RecordingHooks.instances[-1]

        sock = trainer_socket_for(state_dir)
        await wait_until(sock.exists)
        for step in (10, 20, 30):
            assert send_report(sock, Progress(step=step, world_size=2))
            await asyncio.sleep(0.1)
        send_report(sock, CheckpointSavedLocally(step=30, world_size=2, path="/ckpt/30", nbytes=1234))
        await wait_until(lambda: any(ch == "telemetry" and m.step == 30 for ch, m in received))
        telem = [m for ch, m in received if ch == "telemetry" and m.step == 30][-1]
        assert isinstance(telem, Telemetry) and telem.world_size == 2 and telem.steps_per_s and telem.steps_per_s > 0
        await wait_until(lambda: any(ch == "events" and m.kind == "checkpoint-saved" for ch, m in received))

        topic = node_topic(FLEET, iid, "commands")
        ckpt = CheckpointCommand(instance_id=iid, reason="rebalance: checkpoint is old")
        await ctl.publish(topic, ckpt.to_json(), qos=1)
        await ctl.publish(topic, ckpt.to_json(), qos=1)  # a redelivery: handled once
        await ctl.publish(topic, LeaveCommand(instance_id="i-someoneelse", reason="x").to_json(), qos=1)
        await ctl.publish(topic, b"{garbage", qos=1)
        await ctl.publish(topic, LeaveCommand(instance_id=iid, reason="removed").to_json(), qos=1)
        await wait_until(lambda: any(c[0] == "leave" for c in hooks.calls))
        await ctl.publish(topic, ShutdownCommand(instance_id=iid, reason="budget spent").to_json(), qos=1)
        await asyncio.wait_for(task, 10)  # the shutdown command stops the agent cleanly
        await wait_until(lambda: any(ch == "status" and m.state == "offline" for ch, m in received))
        collector.cancel()

    kinds = [c[0] for c in hooks.calls]
    assert kinds == ["checkpoint_saved", "checkpoint", "leave", "shutdown"]
    assert hooks.stopped


async def test_broker_restart_mid_run_loses_no_qos1_event(mosquitto_factory, tmp_path) -> None:
    """200 events published while the broker is stopped and restarted on the same port: the
    controller's intake receives every one of them (duplicates allowed, de-duplicated)."""
    from agent.node.mqtt_session import MqttSession
    from agent.node.outbox import Outbox
    from fleetd.intake.mqtt import MqttIntake
    from fleetd.intake.registry import NodeRegistry
    from fleetd.protocol.messages import CheckpointSaved
    from fleetd.shared.backoff import Backoff

    # Production brokers persist sessions, so the controller's subscription survives a restart.
    broker = mosquitto_factory(extra_config=f"persistence true\npersistence_location {tmp_path}/\n").start()
    registry = NodeRegistry()
    intake = MqttIntake(MqttConfig(url=broker.url, keepalive_s=5), FLEET, registry, backoff_max_s=0.5)
    iid = "i-00000000000000a03"
    session = MqttSession(
        MqttConfig(url=broker.url, keepalive_s=5),
        fleet=FLEET,
        instance_id=iid,
        outbox=Outbox(tmp_path / "outbox.jsonl"),
        on_command=lambda m: asyncio.sleep(0),
        backoff=Backoff(0.1, 0.5),
    )
    total = 200
    async with asyncio.TaskGroup() as tg:
        intake_task = tg.create_task(intake.run())
        session_task = tg.create_task(session.run())
        await asyncio.wait_for(intake.connected.wait(), 10)
        await asyncio.wait_for(session.connected.wait(), 10)

        async def produce() -> None:
            for step in range(total):
                await session.publish_event(CheckpointSaved(instance_id=iid, step=step, world_size=1))
                await asyncio.sleep(0.01)

        producer = tg.create_task(produce())
        await asyncio.sleep(0.6)
        await asyncio.to_thread(broker.stop)
        await asyncio.sleep(1.0)
        assert not session.connected.is_set() and len(session.outbox) > 0
        await asyncio.to_thread(broker.start)
        await producer
        steps: set[int] = set()
        deadline = time.monotonic() + 20
        while len(steps) < total and time.monotonic() < deadline:
            steps |= {e.message.step for e in registry.drain_training_events()}
            await asyncio.sleep(0.05)
        intake_task.cancel()
        session_task.cancel()

    assert steps == set(range(total)), f"lost {sorted(set(range(total)) - steps)[:20]}"
    assert session.connects >= 2
    assert len(session.outbox) == 0
    assert (tmp_path / "outbox.jsonl").read_text() == ""  # journal compacted once all were acked


class BrokenHooks(LoggingHooks):
    async def run(self):
        raise RuntimeError("supervisor bug")

    async def on_notice(self, notice):
        raise RuntimeError("emergency path bug")


async def test_hook_bugs_never_stop_the_watcher_or_the_publishing(mosquitto, state_dir) -> None:
    iid = "i-00000000000000a04"
    async with FakeImds(instance_id=iid) as fake, aiomqtt.Client(mosquitto.host, mosquitto.port) as sub:
        await sub.subscribe(node_topic(FLEET, iid, "events"), qos=1)
        agent = Agent(agent_config(fake.url, mosquitto.url, state_dir), BrokenHooks)
        task = asyncio.create_task(agent.run())
        await wait_until(lambda: agent.session is not None and agent.session.connected.is_set())
        fake.schedule_notice(in_s=0)
        async with asyncio.timeout(5):
            async for m in sub.messages:
                assert parse_message(m.payload).kind == "notice"
                break
        fake.clear_signals()
        fake.schedule_rebalance(in_s=0)
        async with asyncio.timeout(5):
            async for m in sub.messages:
                assert parse_message(m.payload).kind == "rebalance"  # still watching after the bug
                break
        assert not task.done()
        agent.request_stop()
        await asyncio.wait_for(task, 10)


async def test_a_node_waiting_for_its_certificate_is_ready_and_handles_its_notice(
    mosquitto, state_dir, monkeypatch
) -> None:
    """The controller is not up yet (its enrolment port refuses): the agent must still tell
    systemd READY (the boot's cloud-final waits on it otherwise) and watch IMDS, so a notice that
    comes before the certificate still reaches the checkpoint path."""
    import socket as socketlib

    from tests.harness.ports import free_port

    iid = "i-00000000000000e01"
    RecordingHooks.instances.clear()
    notify = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM)
    notify_path = str(state_dir / "notify.sock")
    notify.bind(notify_path)
    notify.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", notify_path)
    dead = f"https://127.0.0.1:{free_port()}/enrol"
    async with FakeImds(instance_id=iid) as fake:
        cfg = agent_config(fake.url, "mqtts://127.0.0.1:8883", state_dir, enrol_url=dead)
        agent = Agent(cfg, RecordingHooks)
        task = asyncio.create_task(agent.run())
        loop = asyncio.get_running_loop()
        ready = await asyncio.wait_for(loop.sock_recv(notify, 4096), 10)
        assert b"READY=1" in ready
        fake.schedule_notice(in_s=0.2)
        await wait_until(lambda: RecordingHooks.instances and RecordingHooks.instances[-1].calls, 5)
        assert RecordingHooks.instances[-1].calls[0][0] == "notice"
        assert agent.session is not None and not agent.session.connected.is_set() and not task.done()
        agent.request_stop()
        await asyncio.wait_for(task, 10)
    notify.close()


async def test_missing_certificate_files_are_retried_not_fatal(mosquitto, state_dir) -> None:
    """A certificate, key or CA file that is missing (or unreadable) fails the MQTT connect, not
    the agent: the IMDS watcher in the same TaskGroup goes on, and a notice is still handled."""
    iid = "i-00000000000000e02"
    RecordingHooks.instances.clear()
    async with FakeImds(instance_id=iid) as fake:
        cfg = agent_config(fake.url, "mqtts://127.0.0.1:8883", state_dir)
        missing = state_dir / "nope"
        cfg = cfg.model_copy(
            update={
                "mqtt": cfg.mqtt.model_copy(
                    update={
                        "ca_file": missing / "ca.crt",
                        "cert_file": missing / "n.crt",
                        "key_file": missing / "n.key",
                    }
                )
            }
        )
        agent = Agent(cfg, RecordingHooks)
        task = asyncio.create_task(agent.run())
        await wait_until(lambda: agent.watcher is not None and agent.watcher.polls >= 2, 10)
        fake.schedule_notice(in_s=0.2)
        await wait_until(lambda: RecordingHooks.instances and RecordingHooks.instances[-1].calls, 5)
        assert not task.done()
        agent.request_stop()
        await asyncio.wait_for(task, 10)
