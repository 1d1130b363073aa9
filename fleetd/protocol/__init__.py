"""What crosses a process boundary: wire messages, topics, rendezvous store keys, the checkpoint
layout in S3, the job's code archive. Plumbing both sides share is in ``fleetd.shared``; the agent
imports nothing else from fleetd."""

from fleetd.protocol.errors import ProtocolError
from fleetd.protocol.messages import (
    SCHEMA_VERSION,
    CheckpointCommand,
    CheckpointSaved,
    CheckpointUploaded,
    Command,
    DrainCommand,
    Event,
    GpuSample,
    LeaveCommand,
    Message,
    Notice,
    Rebalance,
    RestartTrainerCommand,
    ShutdownCommand,
    Status,
    Telemetry,
    TrainerExited,
    WorkerLogs,
    parse_message,
)
from fleetd.protocol.topics import NodeTopic, decode, fleet_filter, node_topic, parse_topic

__all__ = [
    "SCHEMA_VERSION",
    "CheckpointCommand",
    "CheckpointSaved",
    "CheckpointUploaded",
    "Command",
    "DrainCommand",
    "Event",
    "GpuSample",
    "LeaveCommand",
    "Message",
    "NodeTopic",
    "Notice",
    "ProtocolError",
    "Rebalance",
    "RestartTrainerCommand",
    "ShutdownCommand",
    "Status",
    "Telemetry",
    "TrainerExited",
    "WorkerLogs",
    "decode",
    "fleet_filter",
    "node_topic",
    "parse_message",
    "parse_topic",
]
