"""MQTT topic names: ``fleetd/<fleet>/nodes/<instance-id>/<channel>``.

Handlers dispatch on the parsed topic and never trust the broker to have filtered: a payload is
accepted only if its kind belongs on the channel it arrived on and its ``instance_id`` matches the
topic (the broker ACL lets an agent write only under its own id; this is the second check).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from fleetd.protocol.errors import ProtocolError
from fleetd.protocol.messages import Message, parse_message

Channel = Literal["status", "telemetry", "events", "commands", "logs"]
CHANNELS: tuple[str, ...] = get_args(Channel)
ROOT = "fleetd"

_LEVEL = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")

# Which message kinds may travel on which channel.
CHANNEL_KINDS: dict[str, frozenset[str]] = {
    "status": frozenset({"status"}),
    "telemetry": frozenset({"telemetry"}),
    "events": frozenset({"notice", "rebalance", "checkpoint-saved", "checkpoint-uploaded", "trainer-exited"}),
    "commands": frozenset({"checkpoint", "drain", "leave", "shutdown", "restart-trainer"}),
    "logs": frozenset({"worker-logs"}),
}

# QoS per channel (DESIGN.md): telemetry is fire-and-forget, everything else at least once.
# Logs are QoS 0 too: a QoS 1 batch would take one of the connection's few in-flight slots (paho's
# window is shared by every QoS 1 publish), and a notice-path event must never wait behind a
# chatty trainer; the node's journal keeps every line, and a lost batch shows on the control host
# as a gap in ``first_line``. The controller still drops a (stream, seq) it has written, so a
# resend (a future QoS 1, a bridge loop) never doubles lines.
CHANNEL_QOS: dict[str, int] = {"status": 1, "telemetry": 0, "events": 1, "commands": 1, "logs": 0}


@dataclass(frozen=True, slots=True)
class NodeTopic:
    fleet: str
    instance_id: str
    channel: str

    def __str__(self) -> str:
        return node_topic(self.fleet, self.instance_id, self.channel)


def _check_level(name: str, value: str) -> str:
    if not _LEVEL.match(value):
        raise ProtocolError(f"{name} {value!r} is not a valid topic level")
    return value


def node_topic(fleet: str, instance_id: str, channel: str) -> str:
    if channel not in CHANNELS:
        raise ProtocolError(f"unknown channel {channel!r}")
    return f"{ROOT}/{_check_level('fleet', fleet)}/nodes/{_check_level('instance id', instance_id)}/{channel}"


def rendezvous_topic(fleet: str) -> str:
    """Where the leading controller publishes (retained) the rendezvous store's endpoint."""
    return f"{ROOT}/{_check_level('fleet', fleet)}/rendezvous"


def fleet_filter(fleet: str, channel: str = "+") -> str:
    """Subscription filter for one channel (or all with '+') of every node in a fleet."""
    if channel != "+" and channel not in CHANNELS:
        raise ProtocolError(f"unknown channel {channel!r}")
    return f"{ROOT}/{_check_level('fleet', fleet)}/nodes/+/{channel}"


def parse_topic(topic: str) -> NodeTopic:
    parts = topic.split("/")
    if len(parts) != 5 or parts[0] != ROOT or parts[2] != "nodes":
        raise ProtocolError(f"topic {topic!r} is not fleetd/<fleet>/nodes/<instance-id>/<channel>")
    _, fleet, _, instance_id, channel = parts
    if channel not in CHANNELS:
        raise ProtocolError(f"topic {topic!r} has unknown channel {channel!r}")
    return NodeTopic(_check_level("fleet", fleet), _check_level("instance id", instance_id), channel)


def decode(topic: str, payload: bytes | str, *, fleet: str | None = None) -> tuple[NodeTopic, Message]:
    """Parse topic and payload together and check they agree. Raises ProtocolError."""
    where = parse_topic(topic)
    if fleet is not None and where.fleet != fleet:
        raise ProtocolError(f"topic {topic!r} belongs to fleet {where.fleet!r}, not {fleet!r}")
    msg = parse_message(payload)
    if msg.kind not in CHANNEL_KINDS[where.channel]:
        raise ProtocolError(f"kind {msg.kind!r} does not belong on channel {where.channel!r}")
    if msg.instance_id != where.instance_id:
        raise ProtocolError(f"payload instance_id {msg.instance_id!r} does not match topic {where.instance_id!r}")
    return where, msg
