"""Which nodes are lost: the two-signal rule.

A node is declared lost only on a terminal EC2 state, or on two independent signals (for example
an interruption notice plus telemetry silence, or an EC2 state change plus the agent's last will).
A missed heartbeat alone never triggers recovery: brokers hiccup and networks partition, and a
false recovery (restarting a healthy job) costs far more than waiting one more pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from fleetd.policy.model import Node, NodePhase

# EC2 states after which the instance can never train again.
TERMINAL_EC2_STATES = frozenset({"shutting-down", "terminated"})
# EC2 states that say "something happened" but not "gone for good" (a spot stop can resume).
STATE_CHANGE_EC2_STATES = frozenset({"stopping", "stopped"})


class Signal(StrEnum):
    NOTICE = "interruption notice"
    SILENCE = "telemetry silence"
    LAST_WILL = "agent offline (last will)"
    STATE_CHANGE = "EC2 state change"


@dataclass(frozen=True, slots=True)
class Verdict:
    node: Node
    lost: bool
    signals: tuple[Signal, ...]
    reason: str


def signals_for(node: Node, now: float, silence_s: float) -> tuple[Signal, ...]:
    found: list[Signal] = []
    if node.notice_at is not None:
        found.append(Signal.NOTICE)
    # Silence only counts for a node that has spoken before: a booting node is not silent.
    if node.last_seen_at is not None and now - node.last_seen_at > silence_s:
        found.append(Signal.SILENCE)
    if node.agent_offline_at is not None and (
        node.last_seen_at is None or node.agent_offline_at >= node.last_seen_at
    ):
        found.append(Signal.LAST_WILL)
    if node.ec2_state in STATE_CHANGE_EC2_STATES:
        found.append(Signal.STATE_CHANGE)
    return tuple(found)


def assess(node: Node, now: float, silence_s: float) -> Verdict:
    """Apply the two-signal rule to one node (``now`` and ``silence_s`` in seconds)."""
    if node.phase is NodePhase.TERMINATED:
        return Verdict(node, True, (), f"{node.instance_id} is already terminated")
    if node.ec2_state in TERMINAL_EC2_STATES:
        return Verdict(
            node, True, (), f"{node.instance_id} is lost: EC2 reports it {node.ec2_state}"
        )
    signals = signals_for(node, now, silence_s)
    names = " + ".join(s.value for s in signals)
    if len(signals) >= 2:
        return Verdict(node, True, signals, f"{node.instance_id} is lost: two signals ({names})")
    if len(signals) == 1:
        return Verdict(
            node,
            False,
            signals,
            f"{node.instance_id} has one signal ({names}); not lost until a second one arrives",
        )
    return Verdict(node, False, (), f"{node.instance_id} is healthy")


def split_lost(
    nodes: tuple[Node, ...], now: float, silence_s: float
) -> tuple[list[Verdict], list[Node]]:
    """(verdicts of lost nodes, nodes still alive)."""
    lost: list[Verdict] = []
    alive: list[Node] = []
    for node in nodes:
        verdict = assess(node, now, silence_s)
        if verdict.lost:
            lost.append(verdict)
        else:
            alive.append(node)
    return lost, alive
