"""The agent's MQTT session: one connection at a time, reconnecting with backoff forever.

It publishes the retained ``status`` (last will: the same Status, ``offline``), events from the
on-disk Outbox at QoS 1, telemetry and worker logs at QoS 0 while connected; it receives this
node's commands and the leader's retained rendezvous endpoint (``on_endpoint``), each checked
before it is handed on. (docs/DESIGN.md "Wire protocol (MQTT)")
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import aiomqtt

from agent.node.outbox import Outbox, OutboxItem
from fleetd.protocol.errors import ProtocolError
from fleetd.protocol.messages import (
    Message,
    NodeState,
    RendezvousEndpoint,
    Status,
    Telemetry,
    WorkerLogs,
    parse_endpoint,
)
from fleetd.protocol.topics import CHANNEL_QOS, decode, node_topic, rendezvous_topic
from fleetd.shared.backoff import Backoff
from fleetd.shared.logs import get_logger
from fleetd.shared.mqtt_options import Client, client_kwargs
from fleetd.shared.settings import MqttConfig

log = get_logger(__name__)

OnCommand = Callable[[Message], Awaitable[None]]
OnEndpoint = Callable[[RendezvousEndpoint], Awaitable[None]]
PUBLISH_TIMEOUT_S = 10.0
MAX_COMMAND_BYTES = 64 * 1024


class MqttSession:
    def __init__(
        self,
        cfg: MqttConfig,
        *,
        fleet: str,
        instance_id: str,
        outbox: Outbox,
        on_command: OnCommand,
        status_fields: dict[str, Any] | None = None,
        backoff: Backoff | None = None,
        on_endpoint: OnEndpoint | None = None,
        identity_ready: asyncio.Event | None = None,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.instance_id = instance_id
        self.outbox = outbox
        self.on_command = on_command
        self.on_endpoint = on_endpoint
        # Set once the node's certificate exists (enrolment): no connection is tried before.
        self.identity_ready = identity_ready
        self.status_fields = dict(status_fields or {})
        self.backoff = backoff or Backoff(0.2, 10.0, jitter=0.25)
        self.state: NodeState = "starting"
        self.connected = asyncio.Event()
        self.connects = 0
        self._client: aiomqtt.Client | None = None
        self._seen_commands: OrderedDict[str, None] = OrderedDict()
        self.topic = {
            ch: node_topic(fleet, instance_id, ch) for ch in ("status", "telemetry", "events", "commands", "logs")
        }
        self.rendezvous_topic = rendezvous_topic(fleet)

    # ------------------------------------------------------------------ public API
    async def publish_event(self, event: Message) -> None:
        """Queue a QoS 1 event; returns once it is held (and journaled), not when delivered."""
        if event.instance_id != self.instance_id:
            raise ValueError(f"event for {event.instance_id} published by {self.instance_id}")
        await self.outbox.put(OutboxItem(event.msg_id, self.topic["events"], event.to_json()))

    async def publish_telemetry(self, telemetry: Telemetry) -> None:
        client = self._client
        if client is None:
            return  # QoS 0: a sample taken while disconnected is simply not sent
        with contextlib.suppress(aiomqtt.MqttError):
            await client.publish(self.topic["telemetry"], telemetry.to_json(), qos=CHANNEL_QOS["telemetry"])

    async def publish_logs(self, batch: WorkerLogs) -> None:
        """A batch of the workers' output (agent/node/log_batcher.py), QoS 0 like telemetry: it
        never takes an in-flight slot a notice-path event may need (fleetd/protocol/topics.py)."""
        client = self._client
        if client is None:
            return
        with contextlib.suppress(aiomqtt.MqttError):
            await client.publish(self.topic["logs"], batch.to_json(), qos=CHANNEL_QOS["logs"])

    async def set_state(self, state: NodeState) -> None:
        """Change the retained status (e.g. ready -> training -> draining)."""
        self.state = state
        client = self._client
        if client is not None:
            with contextlib.suppress(aiomqtt.MqttError, TimeoutError):
                await self._publish_status(client, state)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Bounded clean goodbye: deliver queued events, then retain status offline.

        The caller cancels ``run()`` afterwards; a graceful disconnect does not fire the will,
        hence the explicit offline status.
        """
        self.state = "offline"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self.connected.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - loop.time() - 1.0)):
                    await self.outbox.wait_empty()
        if len(self.outbox):
            log.warning("mqtt_close_undelivered", events=len(self.outbox), journaled=self.outbox.journal is not None)
        client = self._client
        if client is not None:
            with contextlib.suppress(aiomqtt.MqttError, TimeoutError):
                async with asyncio.timeout(max(0.1, deadline - loop.time())):
                    await self._publish_status(client, "offline")

    # ------------------------------------------------------------------ connection loop
    def _status(self, state: NodeState) -> Status:
        return Status(instance_id=self.instance_id, state=state, **self.status_fields)

    async def _publish_status(self, client: aiomqtt.Client, state: NodeState) -> None:
        await client.publish(self.topic["status"], self._status(state).to_json(), qos=1, retain=True)

    def _make_client(self, broker: MqttConfig) -> Client:
        # Set at every connect: a killed agent or a dead node shows up offline without the
        # controller timing anything out.
        will = aiomqtt.Will(self.topic["status"], self._status("offline").to_json(), qos=1, retain=True)
        return Client(
            identifier=f"fleet-agent-{self.fleet}-{self.instance_id}",
            will=will,
            clean_session=True,
            **client_kwargs(broker, timeout_s=PUBLISH_TIMEOUT_S),
        )

    async def run(self) -> None:
        attempt = 0  # which broker of [url, *fallback_urls]: the next one after each failure
        if self.identity_ready is not None and not self.identity_ready.is_set():
            log.info("mqtt_waiting_for_identity", why="enrolment has not issued this node's certificate yet")
            await self.identity_ready.wait()
        while True:
            broker = self.cfg.broker(attempt)
            try:
                async with self._make_client(broker) as client:
                    self._client = client
                    self.connects += 1
                    self.backoff.reset()
                    await client.subscribe(self.topic["commands"], qos=CHANNEL_QOS["commands"])
                    if self.on_endpoint is not None:
                        # Retained: every (re)connect delivers the newest endpoint again; the
                        # follower ignores one it already follows.
                        await client.subscribe(self.rendezvous_topic, qos=1)
                    await self._publish_status(client, self.state)
                    self.connected.set()
                    log.info(
                        "mqtt_connected",
                        broker=f"{broker.host}:{broker.port}",
                        connects=self.connects,
                        queued_events=len(self.outbox),
                    )
                    async with asyncio.TaskGroup() as tg:
                        tg.create_task(self._pump_events(client))
                        tg.create_task(self._receive_commands(client))
            except* (FileNotFoundError, PermissionError, IsADirectoryError, ssl.SSLError) as group:
                # The certificate, key or CA file is missing or unreadable (a renewal in flight,
                # a permission): retried like a lost broker, never fatal. The IMDS watcher, in
                # the same TaskGroup, must go on watching for a notice.
                log.error(
                    "mqtt_tls_files_unusable",
                    error="; ".join(str(e) for e in group.exceptions),
                    cert_file=str(self.cfg.cert_file),
                    ca_file=str(self.cfg.ca_file),
                )
            except* (aiomqtt.MqttError, TimeoutError) as group:
                attempt += 1
                log.warning(
                    "mqtt_disconnected",
                    broker=f"{broker.host}:{broker.port}",
                    error="; ".join(str(e) for e in group.exceptions),
                    next_broker=self.cfg.broker(attempt).url,
                )
            finally:
                self._client = None
                self.connected.clear()
            await asyncio.sleep(self.backoff.next_delay())

    async def _pump_events(self, client: aiomqtt.Client) -> None:
        while True:
            item = await self.outbox.first()  # the oldest unacknowledged event, after a reconnect too
            # Raises MqttError/TimeoutError on a lost connection: the item stays queued.
            await client.publish(item.topic, item.payload, qos=CHANNEL_QOS["events"], timeout=PUBLISH_TIMEOUT_S)
            await self.outbox.ack(item.msg_id)

    async def _receive_commands(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            topic = str(message.topic)
            if topic == self.rendezvous_topic:
                await self._handle_endpoint(topic, message.payload)
            else:
                await self._handle_command(topic, message.payload)

    async def _handle_endpoint(self, topic: str, payload: Any) -> None:
        if self.on_endpoint is None:
            return
        if not isinstance(payload, (bytes, bytearray, str)) or not payload or len(payload) > MAX_COMMAND_BYTES:
            # An empty retained payload is a cleared topic, not an endpoint.
            log.warning("mqtt_endpoint_rejected", topic=topic, error="payload missing, empty or too large")
            return
        try:
            endpoint = parse_endpoint(bytes(payload) if not isinstance(payload, str) else payload)
        except ProtocolError as exc:
            log.warning("mqtt_endpoint_rejected", topic=topic, error=str(exc))
            return
        log.info(
            "mqtt_endpoint",
            host=endpoint.host,
            port=endpoint.port,
            generation=endpoint.generation,
            leader=endpoint.leader,
        )
        await self.on_endpoint(endpoint)

    async def _handle_command(self, topic: str, payload: Any) -> None:
        if not isinstance(payload, (bytes, bytearray, str)) or len(payload) > MAX_COMMAND_BYTES:
            log.warning("mqtt_command_rejected", topic=topic, error="payload missing or too large")
            return
        try:
            where, msg = decode(topic, bytes(payload) if not isinstance(payload, str) else payload, fleet=self.fleet)
            # Never trust the broker to filter: the topic and the payload must name this node.
            if where.channel != "commands" or where.instance_id != self.instance_id:
                raise ProtocolError(f"topic {topic!r} is not this node's command topic")
        except ProtocolError as exc:
            log.warning("mqtt_command_rejected", topic=topic, error=str(exc))
            return
        if msg.msg_id in self._seen_commands:
            log.debug("mqtt_command_duplicate", msg_id=msg.msg_id)
            return
        self._seen_commands[msg.msg_id] = None
        while len(self._seen_commands) > 1000:
            self._seen_commands.popitem(last=False)
        log.info("mqtt_command", kind=msg.kind, msg_id=msg.msg_id)
        await self.on_command(msg)
