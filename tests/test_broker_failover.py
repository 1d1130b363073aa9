"""Broker HA (issue 19): a mosquitto bridge pair, and clients that fail over between its brokers.

Two real mosquittos; A bridges ``fleetd/#`` both ways to B (deploy/mosquitto/bridge.conf's
setting). The controller's intake (fleetd.intake.mqtt) and an agent's session
(agent.node.mqtt_session) each get an ordered broker list (``[mqtt] url`` + ``fallback_urls``)
and start on different brokers, so every message crosses the bridge. Then the agent's broker is
SIGKILLed: the agent moves to the other one; later the other is SIGKILLed (the first back by
then): both move again. Throughout: the agent's events reach the controller, the controller's
commands reach the agent, and the retained rendezvous endpoint is served by whichever broker the
agent lands on. No timed asserts (generous waits only).
"""

from __future__ import annotations

import asyncio
import signal
import time

import aiomqtt
import pytest

from agent.node.mqtt_session import MqttSession
from agent.node.outbox import Outbox
from fleetd.intake.mqtt import MqttIntake
from fleetd.intake.registry import NodeRegistry
from fleetd.protocol.messages import CheckpointSaved, LeaveCommand, RendezvousEndpoint
from fleetd.protocol.topics import rendezvous_topic
from fleetd.shared.backoff import Backoff
from fleetd.shared.settings import MqttConfig
from tests.harness.mosquitto import Mosquitto

FLEET = "bridged"
IID = "i-0000000000000b001"
BRIDGE = """
connection fleetd-pair
address 127.0.0.1:{port}
topic fleetd/# both 1
try_private true
cleansession true
restart_timeout 1
notifications false
bridge_protocol_version mqttv311
"""


async def until(pred, timeout: float, what: str) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


async def bridged(a: Mosquitto, b: Mosquitto, timeout: float = 30.0) -> None:
    """A message published on A is seen on B (the bridge is up)."""
    async with aiomqtt.Client(b.host, b.port) as sub, aiomqtt.Client(a.host, a.port) as pub:
        await sub.subscribe(f"fleetd/{FLEET}/probe", qos=1)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            await pub.publish(f"fleetd/{FLEET}/probe", b"x", qos=1)
            try:
                async with asyncio.timeout(0.5):
                    async for _ in sub.messages:
                        return
            except TimeoutError:
                continue
    raise AssertionError("the bridge did not come up")


def sigkill(broker: Mosquitto) -> None:
    assert broker.proc is not None
    broker.proc.send_signal(signal.SIGKILL)
    broker.proc.wait()
    broker.proc = None


def test_the_broker_list_is_tried_in_turn_and_validated() -> None:
    cfg = MqttConfig(url="mqtts://a.fleet:8883", fallback_urls=("mqtts://b.fleet:8883",))
    assert [(cfg.broker(n).host, cfg.broker(n).port) for n in range(4)] == [
        ("a.fleet", 8883),
        ("b.fleet", 8883),
        ("a.fleet", 8883),
        ("b.fleet", 8883),
    ]
    assert cfg.broker(0) is cfg and MqttConfig().broker(5) == MqttConfig(), "one broker: always that one"
    with pytest.raises(ValueError, match="fallback_urls"):
        MqttConfig(url="mqtt://a:1883", fallback_urls=("tcp://b:1883",))


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_agent_and_controller_fail_over_between_a_bridged_pair(mosquitto_factory) -> None:
    b = mosquitto_factory().start()
    a = mosquitto_factory(extra_config=BRIDGE.format(port=b.port)).start()
    await bridged(a, b)

    registry = NodeRegistry()
    intake = MqttIntake(
        MqttConfig(url=b.url, fallback_urls=(a.url,), keepalive_s=5),
        FLEET,
        registry,
        client_id="fleetd-ctl-a",
        backoff_max_s=1.0,
    )
    commands: list[LeaveCommand] = []
    endpoints: list[RendezvousEndpoint] = []

    async def on_command(cmd) -> None:  # noqa: ANN001
        commands.append(cmd)

    async def on_endpoint(ep: RendezvousEndpoint) -> None:
        endpoints.append(ep)

    session = MqttSession(
        MqttConfig(url=a.url, fallback_urls=(b.url,), keepalive_s=5),
        fleet=FLEET,
        instance_id=IID,
        outbox=Outbox(None),
        on_command=on_command,
        on_endpoint=on_endpoint,
        backoff=Backoff(0.2, 1.0),
    )
    saved: list[int] = []

    def events_seen() -> list[int]:
        saved.extend(e.message.step for e in registry.drain_training_events() if isinstance(e.message, CheckpointSaved))
        return saved

    async def round_trip(n: int, what: str) -> None:
        """An agent event reaches the controller, a controller command reaches the agent."""
        await session.publish_event(CheckpointSaved(instance_id=IID, step=n, world_size=1))
        await until(lambda: n in events_seen(), 30, f"event {n} at the controller ({what})")
        before = len(commands)
        await until(lambda: intake.connected.is_set(), 30, "the controller connected")
        await intake.send_command(LeaveCommand(instance_id=IID, reason=f"round {n}"))
        await until(lambda: len(commands) > before, 30, f"command {n} at the agent ({what})")
        assert commands[-1].reason == f"round {n}"

    tasks = [asyncio.create_task(intake.run()), asyncio.create_task(session.run())]
    try:
        await until(lambda: intake.connected.is_set() and session.connected.is_set(), 30, "both connected")
        # The leader's endpoint, retained, published on B (the controller's broker): the agent on
        # A receives it across the bridge, and A keeps a retained copy.
        ep = RendezvousEndpoint(host="10.0.0.5", port=29400, run_id="r", leader="ctl-a", generation=1)
        await intake.publish_retained(rendezvous_topic(FLEET), ep.to_json())
        await until(lambda: len(endpoints) >= 1, 30, "the endpoint across the bridge")
        assert registry.record(IID) is not None, "the agent's retained status crossed the bridge"
        await round_trip(1, "agent on A, controller on B")

        # -- A (the agent's broker) dies: the agent moves to B, and gets the retained endpoint there.
        sigkill(a)
        seen = len(endpoints)
        await until(lambda: session.connects >= 2 and session.connected.is_set(), 60, "the agent on B")
        await until(lambda: len(endpoints) > seen, 30, "the retained endpoint from B")
        assert endpoints[-1] == ep
        await round_trip(2, "both on B")

        # -- A comes back (the bridge to B re-forms, B's retained messages flow to A), then B dies:
        # both move to A; the endpoint is still retained there.
        a.start()
        await bridged(a, b)
        sigkill(b)
        seen = len(endpoints)
        await until(lambda: session.connects >= 3 and session.connected.is_set(), 60, "the agent on A again")
        # The controller has never been on A: until it subscribes there, an event the agent
        # publishes on A reaches no one (B, across the bridge, is dead). That loss is the
        # documented one (DESIGN, "High availability": an event a broker acknowledged but could not
        # forward); this round checks what happens once both are on A.
        await until(lambda: intake.connects >= 2 and intake.connected.is_set(), 60, "the controller on A")
        await until(lambda: len(endpoints) > seen, 30, "the retained endpoint from A")
        assert endpoints[-1] == ep
        await round_trip(3, "both on A")
        assert events_seen() == [1, 2, 3], "each event delivered once to the controller"
        assert [c.reason for c in commands] == ["round 1", "round 2", "round 3"]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
