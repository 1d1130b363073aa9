"""Which nodes are lost: the rule of two independent signals (pure).

A node is lost on a terminal EC2 state, or when two *sources* agree: broker (telemetry silence,
last will), store (no new heartbeat), ec2 (stopping, stopped), notice (once its deadline passed).
Broker + store counts only while another node is heard on both: a fault of the control host's own
network cuts both for every node (docs/DESIGN.md "Partitions: signals from independent sources").
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
    STORE_SILENCE = "rendezvous heartbeat silence"


class Source(StrEnum):
    """The fault behind a signal: signals of one source are one piece of evidence."""

    BROKER = "broker connection"
    STORE = "store connection"
    EC2 = "EC2"
    NOTICE = "AWS notice"


SOURCE = {
    Signal.SILENCE: Source.BROKER,
    Signal.LAST_WILL: Source.BROKER,
    Signal.STORE_SILENCE: Source.STORE,
    Signal.STATE_CHANGE: Source.EC2,
    Signal.NOTICE: Source.NOTICE,
}


@dataclass(frozen=True, slots=True)
class Verdict:
    node: Node
    lost: bool
    signals: tuple[Signal, ...]
    reason: str


def broker_silent(node: Node, now: float, silence_s: float) -> bool:
    # Silence only counts for a node that has spoken before: a booting node is not silent.
    return node.last_seen_at is not None and now - node.last_seen_at > silence_s


def store_silent(node: Node, now: float, store_silence_s: float | None) -> bool:
    # Only a node the store has heard from: one still booting or joining is not silent.
    return store_silence_s is not None and node.store_seen_at is not None and now - node.store_seen_at > store_silence_s


def signals_for(node: Node, now: float, silence_s: float, store_silence_s: float | None = None) -> tuple[Signal, ...]:
    found: list[Signal] = []
    if node.notice_at is not None and (node.notice_deadline is None or now >= node.notice_deadline):
        # Before its deadline a notice says the node *will* go, not that it has: the node's own
        # notice flow (checkpoint, upload, leave) is then the best use of it, and a store or
        # broker that lags under load must not cut it short (a loaded storm run terminated a
        # noticed node 0.5 s into its notice this way). A dead noticed node costs at most the
        # rest of its notice; its replacement is bought on the notice anyway.
        found.append(Signal.NOTICE)
    if broker_silent(node, now, silence_s):
        found.append(Signal.SILENCE)
    if node.agent_offline_at is not None and (node.last_seen_at is None or node.agent_offline_at >= node.last_seen_at):
        found.append(Signal.LAST_WILL)
    if node.ec2_state in STATE_CHANGE_EC2_STATES:
        found.append(Signal.STATE_CHANGE)
    if store_silent(node, now, store_silence_s):
        found.append(Signal.STORE_SILENCE)
    return tuple(found)


def assess(
    node: Node, now: float, silence_s: float, store_silence_s: float | None = None, control_host_reachable: bool = True
) -> Verdict:
    """Apply the rule to one node (``now`` and the thresholds in seconds).

    ``control_host_reachable``: some other node is heard on both the broker and the store, so
    broker + store silence of this node is this node's fault (see the module docstring)."""
    if node.phase is NodePhase.TERMINATED:
        return Verdict(node, True, (), f"{node.instance_id} is already terminated")
    if node.ec2_state in TERMINAL_EC2_STATES:
        return Verdict(node, True, (), f"{node.instance_id} is lost: EC2 reports it {node.ec2_state}")
    signals = signals_for(node, now, silence_s, store_silence_s)
    sources = {SOURCE[s] for s in signals}
    if not control_host_reachable and sources >= {Source.BROKER, Source.STORE}:
        # Every node went quiet on both: the control host's network, not this node.
        sources -= {Source.BROKER, Source.STORE}
        sources.add(Source.BROKER)
    names = " + ".join(s.value for s in signals)
    if len(sources) >= 2:
        count = "two signals" if len(signals) == 2 else f"{len(signals)} signals"
        return Verdict(
            node,
            True,
            signals,
            f"{node.instance_id} is lost: {count} ({names}) from {len(sources)} independent sources",
        )
    if signals:
        source = next(iter(sources))
        return Verdict(
            node,
            False,
            signals,
            f"{node.instance_id} has signals from one source only ({names}: {source.value}); "
            "not lost until a second source agrees",
        )
    return Verdict(node, False, (), f"{node.instance_id} is healthy")


def control_host_reachable(
    nodes: tuple[Node, ...], now: float, silence_s: float, store_silence_s: float | None
) -> dict[str, bool]:
    """Per node: is some *other* node heard on both the broker and the store right now?"""
    witnesses = [
        n.instance_id
        for n in nodes
        if n.last_seen_at is not None
        and n.store_seen_at is not None
        and not broker_silent(n, now, silence_s)
        and not store_silent(n, now, store_silence_s)
    ]
    return {n.instance_id: any(w != n.instance_id for w in witnesses) for n in nodes}


def split_lost(
    nodes: tuple[Node, ...], now: float, silence_s: float, store_silence_s: float | None = None
) -> tuple[list[Verdict], list[Node]]:
    """(verdicts of lost nodes, nodes still alive)."""
    reachable = control_host_reachable(nodes, now, silence_s, store_silence_s)
    lost: list[Verdict] = []
    alive: list[Node] = []
    for node in nodes:
        verdict = assess(node, now, silence_s, store_silence_s, reachable[node.instance_id])
        if verdict.lost:
            lost.append(verdict)
        else:
            alive.append(node)
    return lost, alive
