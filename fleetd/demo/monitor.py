"""What the demo sees on the wire: it subscribes to the fleet's topics like any operator tool.

Payloads are decoded with the protocol's own checks (topic and payload must agree); anything
else is counted and dropped, never trusted to the broker's filtering.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

import aiomqtt

from fleetd.protocol import ProtocolError, Telemetry, decode, fleet_filter
from fleetd.shared.logs import get_logger
from fleetd.shared.mqtt_options import Client, client_kwargs
from fleetd.shared.settings import MqttConfig

log = get_logger(__name__)


@dataclass
class WireView:
    fleet: str
    telemetry: dict[str, Telemetry] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)
    events: list[tuple[float, str, str, str]] = field(default_factory=list)  # (t, iid, kind, detail)
    kinds: Counter[str] = field(default_factory=Counter)
    # step -> when it became durable, by the sender's clock (wall): messages from a node that is
    # being terminated can reach the view after it is gone.
    durable_at: dict[int, float] = field(default_factory=dict)
    rejected: int = 0

    async def run(self, mqtt: MqttConfig) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with Client(identifier="fleetd-demo-view", **client_kwargs(mqtt)) as client:
                    await client.subscribe(fleet_filter(self.fleet), qos=1)
                    async for m in client.messages:
                        self.handle(str(m.topic), m.payload, loop.time())
            except aiomqtt.MqttError as exc:
                log.warning("demo_view_disconnected", error=str(exc))
                await asyncio.sleep(1.0)

    def handle(self, topic: str, payload: object, now: float) -> None:
        try:
            where, msg = decode(topic, payload if isinstance(payload, (bytes, str)) else b"", fleet=self.fleet)
        except ProtocolError:
            self.rejected += 1
            return
        self.kinds[msg.kind] += 1
        if msg.kind == "telemetry":
            self.telemetry[where.instance_id] = msg
        elif msg.kind == "status":
            self.status[where.instance_id] = msg.state
        elif msg.kind == "checkpoint-uploaded":
            # Every node uploads every periodic save; the view shows the moment a step is durable.
            if msg.complete:
                self.events.append((now, where.instance_id, "durable", f"step {msg.step} in S3"))
                sent = msg.sent_at.timestamp()
                self.durable_at[msg.step] = min(sent, self.durable_at.get(msg.step, sent))
        elif msg.kind != "checkpoint-saved":
            self.events.append((now, where.instance_id, msg.kind, _detail(msg)))


def _detail(msg: object) -> str:
    fields = {"notice": ("action",), "trainer-exited": ("exit_code", "reason", "last_step")}
    names = fields.get(getattr(msg, "kind", ""), ())
    return " ".join(f"{n}={getattr(msg, n)}" for n in names if getattr(msg, n, None) is not None)
