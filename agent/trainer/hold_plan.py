"""Who saves for a hold that protects leaving nodes, and who waits for whom.

With replicated state every node's copy of step N is the whole state, and a leaver's copy dies
with its node: fleetd terminates a node once it has left, before an upload of that copy could
finish, so the copy that carries the job on is always a staying node's. When at least one node
of the world stays, a leaving node's ranks therefore save nothing: they stop at step N, ack it
``held_only`` and their agent leaves at once, instead of staying billed through a save it does not
need. The staying nodes save; no world-wide barrier joins the two (it would keep the leavers
until the slowest save ends), only a wait on the node's own copy (its local rank 0 writes it).
The survivors' workers are not restarted before their acks are in: fleetd's steering waits for
them (fleetd/rendezvous/held_step.py).

Every rank reaches the same plan from the same inputs (the requests agreed at this step, the
world's shape), so the collectives stay matched. Sharded state and a world that is leaving
whole save as before: every shard, or every copy, is needed.
(docs/DESIGN.md "One interruption, end to end")
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from agent.trainer import local_ckpt
from agent.trainer.local_ckpt import Mode


@dataclass(frozen=True, slots=True)
class HoldPlan:
    save: bool  # this rank's node writes its copy of the step (its local rank 0 does)
    world_barrier: bool  # every rank waits for every node's copy before it acks


SAVE_EVERYWHERE = HoldPlan(save=True, world_barrier=True)


def plan_hold(
    mode: Mode, hold: bool, leaving: tuple[str, ...], node_addr: str, world_size: int, local_world_size: int
) -> HoldPlan:
    """The plan for answering requests agreed at one step: ``hold`` if any of them holds,
    ``leaving`` every node address they name."""
    if not hold or not leaving or mode != "state_dict" or local_world_size < 1:
        return SAVE_EVERYWHERE
    if world_size % local_world_size:
        return SAVE_EVERYWHERE  # nodes of unequal sizes: the node count cannot be told
    if len(set(leaving)) >= world_size // local_world_size:
        # Nobody may stay (the names can include nodes already gone: the count errs towards
        # saving). A node noticed whose request has not come yet counts as staying: it saves,
        # and its own leave then uploads that copy (agent/supervise/emergency.py).
        return SAVE_EVERYWHERE
    return HoldPlan(save=node_addr not in leaving, world_barrier=False)


def wait_for_local_copy(root: Path, step: int, timeout_s: float, poll_s: float = 0.01) -> bool:
    """A rank other than its node's local rank 0: wait until that rank's copy of ``step`` is
    complete on this node's disk (what the world barrier guaranteed). False when it never came."""
    until = time.monotonic() + timeout_s
    directory = local_ckpt.step_dir(root, step)
    while not local_ckpt.is_complete(directory, "state_dict"):
        if time.monotonic() >= until:
            return False
        time.sleep(poll_s)
    return True
