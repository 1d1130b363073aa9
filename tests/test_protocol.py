"""Wire protocol: every kind round-trips; bad payloads are rejected with a reason; topics parse."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from fleetd.protocol import (
    CheckpointCommand,
    CheckpointSaved,
    CheckpointUploaded,
    DrainCommand,
    GpuSample,
    LeaveCommand,
    Notice,
    ProtocolError,
    Rebalance,
    RestartTrainerCommand,
    ShutdownCommand,
    Status,
    Telemetry,
    TrainerExited,
    WorkerLogs,
    decode,
    fleet_filter,
    node_topic,
    parse_message,
    parse_topic,
)
from fleetd.protocol.messages import MESSAGE_KINDS, SCHEMA_VERSION, LogLine
from fleetd.protocol.topics import CHANNEL_KINDS

IID = "i-0123456789abcdef0"
T = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)

EXAMPLES = [
    Status(instance_id=IID, state="training", instance_type="g5.xlarge", zone="us-east-1a", lifecycle="spot"),
    Telemetry(
        instance_id=IID,
        gpus=(GpuSample(index=0, util_pct=93.5, mem_used_mib=20000, mem_total_mib=24576),),
        cpu_pct=41.0,
        mem_used_pct=30.0,
        step=1200,
        steps_per_s=3.5,
        world_size=3,
    ),
    Notice(instance_id=IID, action="terminate", action_time=T + timedelta(minutes=2)),
    Rebalance(instance_id=IID, notice_time=T),
    CheckpointSaved(instance_id=IID, step=1200, world_size=3, nbytes=1 << 20, duration_s=0.4),
    CheckpointUploaded(
        instance_id=IID,
        step=1200,
        files=2,
        nbytes=1 << 20,
        s3_prefix="ckpt/train/step-1200",
        duration_s=1.5,
        beat_deadline=True,
    ),
    TrainerExited(instance_id=IID, exit_code=0, reason="leave", last_step=1200),
    CheckpointCommand(instance_id=IID, reason="notice on i-1", deadline=T),
    DrainCommand(instance_id=IID, reason="spot notice"),
    LeaveCommand(instance_id=IID, reason="removed from rendezvous"),
    ShutdownCommand(instance_id=IID, reason="budget exhausted"),
    RestartTrainerCommand(instance_id=IID, reason="stalled: trainers exited"),
    WorkerLogs(
        instance_id=IID,
        job="train",
        stream="s1",
        seq=3,
        first_line=120,
        dropped=2,
        lines=(LogLine(text="[default0]:step 100", rank=0), LogLine(text="torchrun: warning")),
    ),
]


def test_examples_cover_every_kind() -> None:
    assert {m.kind for m in EXAMPLES} == MESSAGE_KINDS


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.kind)
def test_round_trip(msg) -> None:
    back = parse_message(msg.to_json())
    assert back == msg
    assert type(back) is type(msg)
    assert back.schema_version == SCHEMA_VERSION
    assert back.sent_at.tzinfo is not None and back.sent_at.utcoffset() == timedelta(0)


def test_sent_at_is_normalised_to_utc() -> None:
    local = datetime(2026, 1, 1, 14, 0, tzinfo=timezone(timedelta(hours=2)))
    m = Status(instance_id=IID, state="ready", sent_at=local)
    assert m.sent_at == datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    assert m.sent_at.tzinfo == UTC


def test_messages_are_frozen() -> None:
    with pytest.raises(ValidationError, match="frozen"):
        EXAMPLES[0].state = "offline"  # type: ignore[misc]


def _payload(**overrides) -> bytes:
    base = json.loads(EXAMPLES[0].to_json())
    base.update(overrides)
    return json.dumps(base).encode()


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"{not json", "invalid json"),
        (b"", "invalid json"),
        (b"[1, 2]", "should be an object"),
        (_payload(kind="reboot"), "unknown kind 'reboot'"),
        (_payload(colour="red"), "colour: unknown field"),
        (_payload(state=42), "state"),
        (_payload(sent_at="yesterday"), "sent_at"),
        (_payload(sent_at="2026-01-01T00:00:00"), "timezone"),
        (_payload(schema_version=SCHEMA_VERSION + 1), "newer than this build"),
        (_payload(instance_id="i-1/+/#"), "instance_id"),
    ],
)
def test_malformed_payloads_are_rejected_with_a_reason(payload: bytes, needle: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        parse_message(payload)
    assert needle.lower() in str(exc.value).lower()


def test_missing_kind_is_named() -> None:
    body = json.loads(EXAMPLES[0].to_json())
    del body["kind"]
    with pytest.raises(ProtocolError, match="missing 'kind'"):
        parse_message(json.dumps(body))


@pytest.mark.parametrize("channel", ["status", "telemetry", "events", "commands", "logs"])
def test_topic_round_trip(channel: str) -> None:
    topic = node_topic("prod-a", IID, channel)
    assert topic == f"fleetd/prod-a/nodes/{IID}/{channel}"
    parsed = parse_topic(topic)
    assert (parsed.fleet, parsed.instance_id, parsed.channel) == ("prod-a", IID, channel)
    assert str(parsed) == topic


@pytest.mark.parametrize(
    "topic",
    [
        "fleetd/prod/nodes/i-1",
        "fleetd/prod/nodes/i-1/status/extra",
        "other/prod/nodes/i-1/status",
        "fleetd/prod/node/i-1/status",
        "fleetd/prod/nodes/i-1/secrets",
        "fleetd/prod/nodes/+/status",
        "fleetd//nodes/i-1/status",
    ],
)
def test_bad_topics_are_rejected(topic: str) -> None:
    with pytest.raises(ProtocolError):
        parse_topic(topic)


def test_builders_refuse_wildcards() -> None:
    with pytest.raises(ProtocolError):
        node_topic("prod", "i-1/#", "status")
    with pytest.raises(ProtocolError):
        node_topic("prod", "i-1", "nope")
    assert fleet_filter("prod", "events") == "fleetd/prod/nodes/+/events"


def test_decode_checks_channel_instance_and_fleet() -> None:
    notice = EXAMPLES[2]
    where, msg = decode(node_topic("prod", IID, "events"), notice.to_json(), fleet="prod")
    assert msg == notice and where.channel == "events"
    with pytest.raises(ProtocolError, match="does not belong on channel"):
        decode(node_topic("prod", IID, "status"), notice.to_json())
    with pytest.raises(ProtocolError, match="does not match topic"):
        decode(node_topic("prod", "i-other", "events"), notice.to_json())
    with pytest.raises(ProtocolError, match="belongs to fleet"):
        decode(node_topic("other", IID, "events"), notice.to_json(), fleet="prod")


def test_every_kind_has_exactly_one_channel() -> None:
    seen = [k for kinds in CHANNEL_KINDS.values() for k in kinds]
    assert sorted(seen) == sorted(MESSAGE_KINDS)
