"""How the simulator carries out the planner's actions the way fleetd's components do (DESIGN.md
"One interruption, end to end"): launches, admissions, drains as one membership round,
terminations. See fleetd/sim/fleetd_policy.py for the model.

A mixin of `fleetd.sim.fleetd_policy.FleetdPolicy` (split from it: one job per module).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleetd.policy.memory import PlannerMemory, after_spot_launch, after_stop
from fleetd.policy.model import (
    Action,
    Drain,
    Launch,
    LaunchPurpose,
    Market,
    MarkPoolUnavailable,
    NodePhase,
    PoolId,
    RequestCheckpoint,
    StopJob,
    Terminate,
    Warn,
)
from fleetd.sim.books import SimNode
from fleetd.sim.engine import ON_DEMAND, World

if TYPE_CHECKING:
    from fleetd.config import FleetdConfig


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """One executed action, in a form the daemon's loop can be compared with."""

    t: float
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.t:.0f}s {self.kind} {self.detail}"


def describe(action: Action) -> tuple[str, str]:
    """(kind, detail) of an action, without its free-text reason."""
    kind = type(action).__name__
    if isinstance(action, Launch):
        return kind, f"{action.count} {action.market.value} {action.purpose.value}"
    if isinstance(action, (Drain, Terminate)):
        return kind, action.instance_id
    if isinstance(action, MarkPoolUnavailable):
        return kind, str(action.pool)
    if isinstance(action, Warn):
        return kind, action.code
    return kind, ""


class ActionsMixin:
    # The state this mixin works on, set up in `FleetdPolicy.__init__` (declarations only).
    cfg: FleetdConfig
    startup_s: float
    reform_s: float
    join_reform_s: float
    leaving_signal: bool
    progress_survives_loss: bool
    upload_gb_per_s: float
    salvage_loss_s: float | None
    phase: dict[str, NodePhase]
    node_pool: dict[str, PoolId]
    node_purpose: dict[str, LaunchPurpose]
    running_since: dict[str, float]
    drain_started: dict[str, float]
    left_at: dict[str, float]
    _joining: list[SimNode] | None
    _leaving: list[SimNode]
    memory: PlannerMemory
    capacity_error_until: float | None
    last_durable_at: float | None
    last_durable_step: int | None
    last_request_at: float | None
    node_s_closed: float

    if TYPE_CHECKING:
        # Defined by `FleetdPolicy`.
        def _pass(self, world: World) -> None: ...
        def _wake_now(self, world: World) -> None: ...
        def _member_lost(self, world: World) -> None: ...

    # --- carrying out actions ------------------------------------------------------------
    def _execute(self, world: World, action: Action) -> None:
        if isinstance(action, Launch):
            self._launch(world, action)
        elif isinstance(action, Drain):
            self._drain(world, action.instance_id)
        elif isinstance(action, Terminate):
            self._terminate(world, action.instance_id)
        elif isinstance(action, RequestCheckpoint):
            self._checkpoint(world, "requested by the planner")
            self.last_request_at = world.now
        elif isinstance(action, StopJob):
            self._checkpoint(world, "before a stop")
            self.memory = after_stop(self.memory, world.now)
            world.set_members([])
            for node_id in self.phase:
                self.phase[node_id] = NodePhase.LEAVING
        elif isinstance(action, MarkPoolUnavailable):
            self.capacity_error_until = action.until
        # Warn: logged through the record only.

    def _checkpoint(self, world: World, detail: str) -> None:
        world.checkpoint(detail=detail)
        self.last_durable_at = world.now
        self.last_durable_step = int(world.progress)

    def _launch(self, world: World, action: Launch) -> None:
        if action.market is Market.SPOT:
            got = world.acquire_spot(action.count)
            self.memory = after_spot_launch(self.memory, bool(got), world.now)
            if len(got) < action.count:
                # CreateFleet's partial fulfilment carries a capacity error for the pool.
                self.capacity_error_until = world.now + self.cfg.capacity.capacity_error_ttl_s
        else:
            got = world.acquire_on_demand(action.count)
        if not got:
            return
        world.log(f"launch {len(got)} {action.market.value}")
        for n in got:
            self.phase[n.id] = NodePhase.PENDING
            self.node_purpose[n.id] = action.purpose
            if action.pools:
                self.node_pool[n.id] = action.pools[0]
        if self.startup_s <= 0:
            self._admit(world, got)
        else:
            world.after(self.startup_s, lambda: self._admit_later(world, got))

    def _admit_later(self, world: World, nodes: list[SimNode]) -> None:
        alive = [n for n in nodes if world.held.get(n.id) is n and self.phase.get(n.id) is NodePhase.PENDING]
        if alive:
            self._admit(world, alive)
            self._pass(world)

    def _admit(self, world: World, nodes: list[SimNode]) -> None:
        """New nodes join at the next round (with the pass's other changes, if in a pass: that
        round runs after this instant's notices, `FleetdPolicy._round_after_notices`)."""
        if self._joining is not None:
            self._joining.extend(nodes)
        else:
            self._membership_round(world, self._ready(world, nodes), [])

    def _ready(self, world: World, nodes: list[SimNode]) -> list[SimNode]:
        """The new nodes that start training. A node noticed before its trainer started starts
        none (DESIGN.md "A wave of notices"; the agent reads IMDS before it starts torchrun): it
        stays out of the rendezvous, so nobody checkpoints or re-forms for it, and it leaves on
        its drain (`_drain`). A node bought inside its notice window is noticed at once."""
        ready = [
            n
            for n in nodes
            if world.held.get(n.id) is n and self.phase.get(n.id) is NodePhase.PENDING and n.notice_at is None
        ]
        for n in ready:
            self.phase[n.id] = NodePhase.RUNNING
            self.running_since[n.id] = world.now
        return ready

    def _drain(self, world: World, node_id: str) -> None:
        node = world.held.get(node_id)
        if node is None:
            return
        if self.phase.get(node_id) is NodePhase.PENDING and node.notice_at is not None:
            # Noticed before it trained: it holds no state and is in no round, so it checkpoints
            # nothing, pokes nobody and says it left at once (DESIGN.md: a non-member noticed ->
            # drain_ready); the planner then terminates it.
            self.phase[node_id] = NodePhase.DRAINING
            self.drain_started[node_id] = world.now
            if self.leaving_signal:
                world.after(0.0, functools.partial(self._left, world, node))
            return
        if self.phase.get(node_id) is not NodePhase.RUNNING:
            return
        # The daemon marks the node DRAINING; it stays billed (idle, out of the rendezvous) until
        # it reports that it left, AWS reclaims it, or the planner's drain timeout ends it.
        self.phase[node_id] = NodePhase.DRAINING
        self.drain_started[node_id] = world.now
        if self.progress_survives_loss and node.notice_deadline is not None and node.notice_deadline > world.now:
            # Can't Be Late's model, which the baselines get too: a checkpoint is free and
            # progress survives a loss, so the noticed node trains on until the reclaim and
            # leaves then (its replacement is bought now, on the notice).
            world.queue.at(node.notice_deadline - 1e-3, lambda: self._membership_round(world, [], [node]))
        elif self._joining is not None:
            self._leaving.append(node)
        else:
            self._membership_round(world, [], [node])

    def _membership_round(self, world: World, joining: list[SimNode], leaving: list[SimNode]) -> None:
        """One rendezvous round for every join and leave decided together: a coordinated
        checkpoint first (a leaver's shard, and the state a newcomer restores), so the re-form
        loses no steps; then every rank waits ``reform_s``."""
        joining = [n for n in joining if world.held.get(n.id) is n]
        leaving = [n for n in leaving if world.held.get(n.id) is n]
        if not joining and not leaving:
            return
        before = world.members()
        kind = " and ".join(k for k, nodes in (("join", joining), ("leave", leaving)) if nodes)
        if before:
            self._checkpoint(world, f"before a {kind}")
        gone = {n.id for n in leaving}
        world.set_members([n for n in before if n.id not in gone] + joining)
        if before or self.startup_s <= 0:
            # (Nobody training and a start-up time given: forming the first round is part of
            # the newcomers' start-up, the changeover d every policy pays.)
            world.stall(self._round_s(joining, leaving), "re-form", after_current=True, detail=kind)
        if self.leaving_signal:
            delay = self._left_delay_s(world, len(before), staying=len(before) > len(gone))
            for node in leaving:
                world.after(delay, functools.partial(self._left, world, node))

    def _round_s(self, joining: list[SimNode], leaving: list[SimNode]) -> float:
        """Every rank's wait for the round: a leave's re-form, or a join's (the newcomer's hold
        checkpoint request to every rank training at the larger size), the longer of the two."""
        return max(self.join_reform_s if joining else 0.0, self.reform_s if leaving else 0.0)

    def _left_delay_s(self, world: World, world_size: int, *, staying: bool) -> float:
        """Drain to trainer-exited. Replicated state with a node that stays: the leaver stops at
        the hold and leaves, saving nothing (agent/trainer/hold_plan.py); charged a re-form's
        time, above the 0.21 s measured from notice to its tree stopped (bench/rebalance.py
        notice_to_left_s, 2026-11-28, loaded 2-core box). Else its checkpoint stall, its shard's
        upload, the leave."""
        if staying and self.salvage_loss_s is not None:  # replicated state (see FleetdPolicy)
            return self.reform_s
        shard_gb = world.job.checkpoint_gb / max(1, world_size)
        return world.job.checkpoint_stall_s + shard_gb / self.upload_gb_per_s + self.reform_s

    def _left(self, world: World, node: SimNode) -> None:
        """The agent reports its trainer exited after the drain (TrainerExited): the registry
        records left_at, and the planner terminates the node on the pass it wakes."""
        if world.held.get(node.id) is node and self.phase.get(node.id) is NodePhase.DRAINING:
            self.left_at[node.id] = world.now
            self._wake_now(world)

    def _terminate(self, world: World, node_id: str) -> None:
        node = world.held.get(node_id)
        if node is None:
            return
        was_member = node.member
        if node.market != ON_DEMAND:
            self.node_s_closed += world.now - node.acquired_at
        self._forget(node_id)
        world.release(node)
        if was_member:  # terminated while training: to the survivors, a loss without notice
            self._member_lost(world)

    def _forget(self, node_id: str) -> NodePhase | None:
        """The node is gone: drop what was kept about it (returns its last phase)."""
        self.drain_started.pop(node_id, None)
        self.left_at.pop(node_id, None)
        self.running_since.pop(node_id, None)
        self.node_pool.pop(node_id, None)
        self.node_purpose.pop(node_id, None)
        return self.phase.pop(node_id, None)
