"""Step 1: terminate nodes that are lost, never booted, have left, or overran their drain."""

from __future__ import annotations

from fleetd.policy.lifecycle import TERMINAL_EC2_STATES, split_lost
from fleetd.policy.model import Node, NodePhase, Terminate
from fleetd.policy.stages.pass_state import PlanPass


def end_departed_nodes(p: PlanPass) -> None:
    cfg, now = p.cfg, p.now
    lost, alive = split_lost(p.obs.nodes, now, cfg.rebalance.silence_s, cfg.loss.store_silence_s)
    for verdict in lost:
        node = verdict.node
        if node.ec2_state in TERMINAL_EC2_STATES or node.phase is NodePhase.TERMINATED:
            p.notes.append(verdict.reason)
        else:
            p.actions.append(
                Terminate(reason=f"{verdict.reason}; terminating so it stops billing", instance_id=node.instance_id)
            )
    p.billed = list(alive)
    p.kept = [n for n in alive if not n.leaving]
    # A silent new node is a broken boot only while other nodes do report: when nobody reports,
    # the broker or the intake is down, and replacing every node would not help.
    others_report = any(n.last_seen_at is not None for n in alive)
    for node in list(p.billed):
        if node.phase is NodePhase.PENDING and node.last_seen_at is None:
            age = now - node.launched_at
            if age > cfg.capacity.boot_timeout_s and others_report:
                p.terminate(
                    node,
                    f"{node.instance_id} never reported in {age:.0f} s (boot_timeout_s "
                    f"{cfg.capacity.boot_timeout_s:.0f}) while other nodes do: broken boot",
                )
        elif node.phase is NodePhase.LEAVING:
            p.terminate(node, f"{node.instance_id} has left the rendezvous: terminating it")
        elif node.phase is NodePhase.DRAINING and node.has_left:
            assert node.left_at is not None  # a draining node has left only once left_at is known
            # Its checkpoint is durable and it is out of the rendezvous: every second it stays
            # up until AWS reclaims it (or the drain times out) is paid for nothing.
            p.terminate(
                node,
                f"{node.instance_id} has left the rendezvous (trainer exited "
                f"{now - node.left_at:.0f} s ago, after its drain): terminating it so it stops billing",
            )
        elif node.phase is NodePhase.DRAINING:
            overdue = _drain_overdue(node, now, cfg.rebalance.drain_timeout_s)
            if overdue:
                p.terminate(node, f"{node.instance_id} drain overdue ({overdue}): terminating it")


def _drain_overdue(node: Node, now: float, timeout_s: float) -> str:
    if node.notice_deadline is not None and now > node.notice_deadline:
        return f"notice deadline passed {now - node.notice_deadline:.0f} s ago"
    if node.drain_started_at is not None and now - node.drain_started_at > timeout_s:
        return f"draining for {now - node.drain_started_at:.0f} s > drain_timeout_s {timeout_s:.0f}"
    return ""
