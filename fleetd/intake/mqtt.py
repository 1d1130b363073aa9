"""Controller side of MQTT: subscribe to the fleet's agent channels, validate, feed the registry.

Every message is checked by ``fleetd.protocol.topics.decode`` (topic shape, fleet, kind allowed on
the channel, payload instance id == topic instance id); the broker's filtering and ACLs are not
trusted. A message that fails is logged once (one line with topic, size and reason) and dropped;
nothing a publisher sends can stop the intake.

The session is persistent (fixed client id, clean_session=False) so the broker queues QoS 1 events
while the controller restarts; duplicates that this causes are dropped by the registry.
The same connection carries commands to agents (``send_command``).
"""

from __future__ import annotations

import asyncio
import select
import time
from collections.abc import Callable
from typing import Any

import aiomqtt
from prometheus_client import Counter

from fleetd.intake.coalesce import CoalescingQueue
from fleetd.intake.events import IntakeEvent, InterruptionNotice, from_message
from fleetd.intake.registry import NodeRegistry
from fleetd.protocol.errors import ProtocolError
from fleetd.protocol.messages import (
    CheckpointCommand,
    DrainCommand,
    LeaveCommand,
    RestartTrainerCommand,
    ShutdownCommand,
    WorkerLogs,
)
from fleetd.protocol.topics import CHANNEL_QOS, decode, fleet_filter, node_topic
from fleetd.shared.backoff import Backoff
from fleetd.shared.failpoints import failpoint
from fleetd.shared.logs import get_logger
from fleetd.shared.mqtt_options import Client, client_kwargs
from fleetd.shared.settings import MqttConfig

log = get_logger(__name__)

# Our largest legitimate message (telemetry of an 8-GPU node) is ~2 KiB.
MAX_PAYLOAD_BYTES = 64 * 1024
AGENT_CHANNELS = ("status", "telemetry", "events", "logs")
PUBLISH_TIMEOUT_S = 10.0
# Messages handled per turn of the event loop once one has arrived: taken straight from the
# inbox instead of one task and one wait per message (what the client library's iterator costs,
# ~100 us a message, more than validating it), then the loop gets a turn (reader, passes).
# Small enough that a turn stays a few milliseconds: every await of a pass (a state read in a
# thread, the planner) waits for the turn under way, and at 256 (~20 ms a turn at 2,000 agents)
# a pass of ~20 awaits spent most of its 0.23 s p50 waiting behind telemetry (bench/agents_load.py).
BATCH = 64
# Packets read per socket wake-up: the client library reads one per event-loop turn, so a
# controller busy planning read a few hundred a second while 2,000 arrived; the rest waited in
# the kernel and then in the broker's queue for us, which dropped them when full. 128 a wake-up
# at a hundred turns a second is still several times what 2,000 agents send.
READ_BURST = 128

# Per channel: accepted vs rejected, so a load test (bench/agents_load.py) or an operator can
# compare what agents sent with what fleetd took in.
INTAKE = Counter("fleetd_intake_messages_total", "Agent messages by channel and result", ["channel", "result"])
# Resolved once: Counter.labels() costs ~25 us, per message at 2,000 messages a second.
_ACCEPTED = {ch: INTAKE.labels(ch, "accepted") for ch in ("status", "telemetry", "events", "commands", "logs")}
# A telemetry sample replaced in the inbox by a newer one from the same node (coalesce.py): not a
# lost message (the newer sample carries the node's current rates), counted apart from "accepted".
_SUPERSEDED = INTAKE.labels("telemetry", "superseded")

Command = CheckpointCommand | DrainCommand | LeaveCommand | ShutdownCommand | RestartTrainerCommand


class BusUnavailable(Exception):
    """The controller is not connected to the broker right now; the command was not sent."""


def _preview(payload: bytes, limit: int = 64) -> str:
    return repr(payload[:limit]) + ("..." if len(payload) > limit else "")


def _telemetry_key(message: aiomqtt.Message) -> str | None:
    """Telemetry coalesces per topic (one node's channel); anything else is an event. The topic
    is not trusted here: ``handle`` validates whatever comes out of the inbox."""
    topic = message.topic.value
    return topic if topic.endswith("/telemetry") else None


def _read_in_bursts(client: aiomqtt.Client) -> None:
    """Have the connection read every packet waiting on the socket per wake-up (up to READ_BURST)
    instead of one: they go into the inbox, where telemetry coalesces. Reaches into the client
    library (aiomqtt 2.x over paho 2.x, pinned in pyproject); when its shape differs, the
    library's one-packet reads stay (slower, never wrong)."""
    paho: Any = getattr(client, "_client", None)
    read_one = getattr(paho, "loop_read", None)
    if read_one is None or not callable(getattr(paho, "socket", None)):
        log.warning("intake_burst_read_unavailable", why="aiomqtt/paho internals changed; one packet per wake-up")
        return

    def loop_read(max_packets: int = 1) -> Any:
        rc = read_one()
        for _ in range(READ_BURST - 1):
            sock = paho.socket()
            if rc != 0 or sock is None or not _readable(sock):
                break
            rc = read_one()
        return rc

    paho.loop_read = loop_read


def _readable(sock: Any) -> bool:
    pending = getattr(sock, "pending", None)  # TLS: bytes already decrypted in the SSL object
    if pending is not None and pending() > 0:
        return True
    return bool(select.select([sock], [], [], 0)[0])


class MqttIntake:
    def __init__(
        self,
        cfg: MqttConfig,
        fleet: str,
        registry: NodeRegistry,
        *,
        subscriptions: tuple[str, ...] | None = None,
        client_id: str | None = None,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        on_logs: Callable[[WorkerLogs], object] | None = None,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.registry = registry
        self.subscriptions = subscriptions or tuple(fleet_filter(fleet, ch) for ch in AGENT_CHANNELS)
        self.client_id = client_id or f"fleetd-{fleet}"
        self.max_payload_bytes = max_payload_bytes
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.clock = clock
        # The workers' output (fleetd/joblogs/store.py): not an intake event, never in the registry.
        # Batches leave the inbox with the events, in order; each is bounded (the node's rate cap
        # and the payload limit) and only queued here, so a notice behind one waits microseconds.
        self.on_logs = on_logs
        self.connected = asyncio.Event()
        self.connects = 0  # subscribed sessions so far (one per broker connection)
        self.accepted = 0
        self.rejected = 0
        self._client: aiomqtt.Client | None = None
        self._inbox: CoalescingQueue[aiomqtt.Message] | None = None
        self.superseded = 0  # valid telemetry samples replaced in the inbox by a newer one

    def _new_inbox(self, maxsize: int = 0) -> CoalescingQueue[aiomqtt.Message]:
        """The client's incoming queue (aiomqtt's ``queue_type``), new per connection."""
        self._inbox = CoalescingQueue(maxsize, key=_telemetry_key, on_superseded=self._superseded)
        return self._inbox

    def _superseded(self, old: aiomqtt.Message) -> None:
        """A sample replaced by a newer one on its topic is validated all the same (not applied):
        a malformed message is rejected and logged as any other, never counted as superseded."""
        if self._decode(str(old.topic), old.payload) is not None:
            self.superseded += 1
            _SUPERSEDED.inc()

    async def run(self) -> None:
        backoff = Backoff(self.backoff_initial_s, self.backoff_max_s)
        delay = self.backoff_initial_s
        attempt = 0  # which broker of [url, *fallback_urls]: the next one after each failure
        while True:
            broker = self.cfg.broker(attempt)
            try:
                async with Client(
                    identifier=self.client_id,
                    clean_session=False,
                    queue_type=self._new_inbox,  # type: ignore[arg-type]
                    **client_kwargs(broker, timeout_s=PUBLISH_TIMEOUT_S),
                ) as client:
                    _read_in_bursts(client)
                    for sub in self.subscriptions:
                        await client.subscribe(sub, qos=1)
                    self._client = client
                    self.connects += 1
                    self.connected.set()
                    backoff.reset()
                    log.info(
                        "intake_mqtt_connected",
                        broker=f"{broker.host}:{broker.port}",
                        subscriptions=list(self.subscriptions),
                    )
                    inbox = self._inbox
                    assert inbox is not None
                    async for message in client.messages:
                        self.handle(str(message.topic), message.payload, retained=message.retain)
                        for _ in range(BATCH):
                            try:
                                message = inbox.get_nowait()
                            except asyncio.QueueEmpty:
                                break
                            self.handle(str(message.topic), message.payload, retained=message.retain)
            except aiomqtt.MqttError as exc:
                attempt += 1
                delay = backoff.next_delay()
                log.warning(
                    "intake_mqtt_disconnected",
                    broker=f"{broker.host}:{broker.port}",
                    error=str(exc),
                    retry_in_s=round(delay, 2),
                    next_broker=self.cfg.broker(attempt).url,
                )
            finally:
                self._client = None
                self.connected.clear()
            await asyncio.sleep(delay)

    def handle(self, topic: str, payload: Any, *, retained: bool = False) -> IntakeEvent | None:
        """Validate one message and apply it; returns the event, or None if it was dropped.

        A retained message (the broker replaying a node's last status on subscribe) is old news:
        it is dated by its ``sent_at``, so a dead node's stale "ready" does not look like a sign
        of life after a controller restart.
        """
        decoded = self._decode(topic, payload)
        if decoded is None:
            return None
        where, msg = decoded
        _ACCEPTED[where.channel].inc()
        if isinstance(msg, WorkerLogs):
            if self.on_logs is not None:
                self.on_logs(msg)
            return None
        now = self.clock()
        event = from_message(msg, min(now, msg.sent_at.timestamp()) if retained else now)
        if event is None:
            log.debug("intake_message_ignored", topic=topic, kind=msg.kind)
            return None
        self.accepted += 1
        self.registry.apply(event)
        if isinstance(event, InterruptionNotice):
            failpoint("notice-received")  # acknowledged to the broker, known only in memory
        return event

    def _decode(self, topic: str, payload: Any) -> tuple[Any, Any] | None:
        """The checked (topic, message), or None: rejected, counted and logged once."""
        if not isinstance(payload, (bytes, bytearray)):
            payload = b"" if payload is None else str(payload).encode()
        payload = bytes(payload)
        try:
            if len(payload) > self.max_payload_bytes:
                raise ProtocolError(f"payload of {len(payload)} bytes exceeds {self.max_payload_bytes}")
            where, msg = decode(topic, payload, fleet=self.fleet)
        except ProtocolError as exc:
            self.rejected += 1
            INTAKE.labels("?", "rejected").inc()
            log.warning(
                "intake_message_rejected",
                topic=topic[:256],
                nbytes=len(payload),
                preview=_preview(payload),
                reason=str(exc)[:500],
            )
            return None
        return where, msg

    async def publish_retained(self, topic: str, payload: bytes) -> None:
        """Publish a retained QoS 1 message (the rendezvous endpoint); BusUnavailable when down."""
        client = self._client
        if client is None:
            raise BusUnavailable(f"not connected to the broker; {topic} not published")
        try:
            await client.publish(topic, payload, qos=1, retain=True, timeout=PUBLISH_TIMEOUT_S)
        except aiomqtt.MqttError as exc:
            raise BusUnavailable(f"{topic} not published: {exc}") from None

    async def send_command(self, command: Command) -> None:
        """Publish a command to its node at QoS 1 (waits for the broker's ack)."""
        client = self._client
        if client is None:
            raise BusUnavailable(f"not connected to the broker; {command.kind} for {command.instance_id} not sent")
        topic = node_topic(self.fleet, command.instance_id, "commands")
        try:
            await client.publish(topic, command.to_json(), qos=CHANNEL_QOS["commands"], timeout=PUBLISH_TIMEOUT_S)
        except aiomqtt.MqttError as exc:
            raise BusUnavailable(f"{command.kind} for {command.instance_id} not sent: {exc}") from None
        log.info("command_sent", kind=command.kind, instance_id=command.instance_id, msg_id=command.msg_id)
