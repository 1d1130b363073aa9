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

Every rank must follow one plan or the collectives mismatch (a rank in a barrier the others
skip hangs). Each rank reads the requests itself, and a late read differs, so the ranks agree
on the plan (`agreed_plan`): the node count from the world, and the inputs checked equal on
every rank, else everybody saves as before. Sharded state and a world that is leaving whole save
as before too: every shard, or every copy, is needed. Without fleetd's steering the survivors
re-form by themselves after the leavers left (agent/trainer/elastic.py ``_hold``); when the
leavers did not wait for the save, that grace also covers the steering's save wait, so a node
that saved fast never restarts one still saving.
(docs/DESIGN.md "One interruption, end to end")
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.trainer import local_ckpt
from agent.trainer.context import TrainerContext
from agent.trainer.local_ckpt import Mode
from fleetd.protocol.rendezvous_keys import HELD_SAVE_WAIT_S


@dataclass(frozen=True, slots=True)
class HoldPlan:
    save: bool  # this rank's node writes its copy of the step (its local rank 0 does)
    world_barrier: bool  # every rank waits for every node's copy before it acks

    @property
    def extra_grace_s(self) -> float:
        """How much longer the survivors hold before re-forming by themselves once the leavers
        left: the steering's save wait, when the leavers did not wait for the save."""
        return 0.0 if self.world_barrier else HELD_SAVE_WAIT_S


SAVE_EVERYWHERE = HoldPlan(save=True, world_barrier=True)


def agreed_plan(
    mode: Mode, hold: bool, leaving: tuple[str, ...], ctx: TrainerContext, all_reduce: Callable[[int, str], int]
) -> HoldPlan:
    """The plan of the whole world (a collective: every rank calls it when it answers)."""
    nodes = all_reduce(int(ctx.local_rank == 0), "SUM")
    digest = zlib.crc32(repr((mode, hold, sorted(set(leaving)))).encode())
    if all_reduce(digest, "MAX") != all_reduce(digest, "MIN"):
        return SAVE_EVERYWHERE  # a rank read the requests differently: the old way is safe
    return plan_hold(mode, hold, leaving, ctx.node_addr, nodes)


def plan_hold(mode: Mode, hold: bool, leaving: tuple[str, ...], node_addr: str, nodes: int) -> HoldPlan:
    """The plan for answering requests agreed at one step: ``hold`` if any of them holds,
    ``leaving`` every node address they name, ``nodes`` in the world."""
    if not hold or not leaving or mode != "state_dict":
        return SAVE_EVERYWHERE
    if len(set(leaving)) >= nodes:
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
