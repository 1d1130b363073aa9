"""Recovery strategies to compare with fleetd's own (which lives in fleetd/sim/fleetd_policy.py).

Cluster jobs: `OnDemandOnly` (a fixed on-demand fleet), `CheckpointRestart` (any loss restarts the
whole job from its last periodic checkpoint, as SkyPilot managed jobs do), `TorchrunElastic`
(torchrun's defaults: each join or leave re-forms in 35-45 s from the last periodic checkpoint).
Single-node deadline jobs (Can't Be Late): `Greedy` and `UniformProgress`. None sees spot appear:
a launch attempt finds it, retried after fleetd's capacity-error TTL (fleetd/sim/engine.py;
docs/DESIGN.md "Placement and deadlines").
"""

from __future__ import annotations

from fleetd.sim import defaults as d
from fleetd.sim.books import SimNode
from fleetd.sim.clock import Timer
from fleetd.sim.engine import ON_DEMAND, SPOT, World

_EPS = 1e-3  # seconds: timers at a computed crossing fire just after it, never before


class _Periodic:
    """Checkpoint every ``interval_s`` of wall time while training (jobs without fleetd)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s

    def arm(self, world: World) -> None:
        def tick() -> None:
            if world.training:
                world.checkpoint(detail="periodic")
            world.after(self.interval_s, tick)

        world.after(self.interval_s, tick)


class OnDemandOnly:
    name = "on-demand"

    def __init__(self, nodes: int, periodic_checkpoint_s: float = d.PERIODIC_CHECKPOINT_S.value):
        self.nodes = nodes
        self.periodic = _Periodic(periodic_checkpoint_s)

    def start(self, world: World) -> None:
        world.set_members(world.acquire_on_demand(self.nodes))
        world.log(f"launch {self.nodes} on-demand")
        self.periodic.arm(world)

    def on_capacity(self, world: World) -> None:
        pass

    def on_notice(self, world: World, node: SimNode) -> None:
        pass

    def on_lost(self, world: World, node: SimNode, noticed: bool) -> None:
        pass


class CheckpointRestart:
    """Whole-job restart on any loss. Generous to the baseline: a relaunch takes every spot
    node available at that moment instead of waiting for a fixed cluster size."""

    name = "checkpoint-restart"

    def __init__(
        self,
        recovery_s: float = d.CHECKPOINT_RESTART_RECOVERY_S.value,
        periodic_checkpoint_s: float = d.PERIODIC_CHECKPOINT_S.value,
    ):
        self.recovery_s = recovery_s
        self.periodic = _Periodic(periodic_checkpoint_s)
        self.waiting = True  # for enough capacity to (re)launch

    def start(self, world: World) -> None:
        self.periodic.arm(world)
        self._relaunch(world)

    def _relaunch(self, world: World) -> None:
        job = world.job
        world.acquire_spot(job.max_nodes - len(world.held))
        if len(world.held) < job.min_nodes:
            world.set_members([])
            self.waiting = True
            return
        self.waiting = False
        world.set_members(list(world.held.values()))
        world.stall(self.recovery_s, "restart")
        world.log(f"relaunch with {len(world.held)} nodes")

    def _relaunching(self, world: World) -> bool:
        return world.now < world.stalled_until and world.stall_reason == "restart"

    def on_capacity(self, world: World) -> None:
        if self.waiting:
            self._relaunch(world)
        elif self._relaunching(world) and len(world.held) < world.job.max_nodes:
            # A retry during the relaunch takes what is offered now (the relaunch waits for it).
            world.set_members(world.members() + world.acquire_spot(world.job.max_nodes - len(world.held)))

    def on_notice(self, world: World, node: SimNode) -> None:
        pass  # the job is not told

    def on_lost(self, world: World, node: SimNode, noticed: bool) -> None:
        world.rollback()
        self._relaunch(world)


class TorchrunElastic:
    name = "torchrun-default"

    def __init__(
        self,
        reform_s: float = d.TORCHRUN_REFORM_S.value,
        periodic_checkpoint_s: float = d.PERIODIC_CHECKPOINT_S.value,
    ):
        self.reform_s = reform_s
        self.periodic = _Periodic(periodic_checkpoint_s)

    def start(self, world: World) -> None:
        self.periodic.arm(world)
        self._reform(world)

    def _reform(self, world: World) -> None:
        job = world.job
        world.acquire_spot(job.max_nodes - len(world.held))
        members = list(world.held.values()) if len(world.held) >= job.min_nodes else []
        world.set_members(members)
        # Workers restart on every membership change and resume from the last checkpoint.
        world.rollback()
        world.stall(self.reform_s, "re-form")

    def on_capacity(self, world: World) -> None:
        # A retry (the ASG launching again) that finds no capacity changes nothing; a node that
        # joins re-forms the job (torchrun restarts the workers on any membership change).
        if len(world.held) < world.job.max_nodes and world.acquire_spot(world.job.max_nodes - len(world.held)):
            self._reform(world)

    def on_notice(self, world: World, node: SimNode) -> None:
        pass  # torchrun does not watch for notices

    def on_lost(self, world: World, node: SimNode, noticed: bool) -> None:
        self._reform(world)


# --- single-node deadline jobs -----------------------------------------------------------
class DeadlineCallbacks:
    """What every deadline baseline shares, for one node (below) or a fleet (deadline_fleet.py):
    each world event runs ``decide``, and ``wake_at`` arms the one timer that re-runs it when a
    computed crossing comes (a line, a safety net, the end of a hysteresis)."""

    name = "deadline"

    def __init__(self, changeover_s: float = d.CHANGEOVER_S.value):
        self.d = changeover_s
        self._wake: Timer | None = None

    def remaining_time(self, world: World) -> float:
        assert world.job.deadline_s is not None, "deadline policies need a deadline"
        return world.job.deadline_s - world.now

    def wake_at(self, world: World, t: float) -> None:
        if self._wake is not None:
            self._wake.cancel()
        self._wake = world.queue.at(max(t, world.now + _EPS), lambda: self.decide(world))

    def decide(self, world: World) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def start(self, world: World) -> None:
        self.decide(world)

    def on_capacity(self, world: World) -> None:
        self.decide(world)

    def on_notice(self, world: World, node: SimNode) -> None:
        pass

    def on_lost(self, world: World, node: SimNode, noticed: bool) -> None:
        self.decide(world)


class _DeadlinePolicy(DeadlineCallbacks):
    """Shared machinery: which market the single node is on, switching with overhead d."""

    # Quantities in seconds of single-node work.
    def remaining_work(self, world: World) -> float:
        pending_stall = max(0.0, world.stalled_until - world.now) if world.members() else 0.0
        return world.remaining_steps / world.job.throughput(1) + pending_stall

    def market(self, world: World) -> str | None:
        for node in world.held.values():
            return node.market
        return None

    def switch(self, world: World, market: str | None) -> None:
        if self.market(world) == market:
            return
        for node in list(world.held.values()):
            world.release(node)
        if market is None:
            world.log("idle")
            return
        nodes = world.acquire_spot(1) if market == SPOT else world.acquire_on_demand(1)
        world.set_members(nodes)
        world.stall(self.d, "changeover")
        world.log(f"run on {market}")


class Greedy(_DeadlinePolicy):
    name = "greedy"

    def decide(self, world: World) -> None:
        if world.done:
            return
        market = self.market(world)
        forced = self.remaining_time(world) <= self.remaining_work(world) + 2 * self.d + _EPS
        if market == SPOT:
            return  # keep spot until it is taken away
        if market == ON_DEMAND and forced:
            return  # no slack left for another changeover: finish on on-demand
        if forced:
            self.switch(world, ON_DEMAND)
        elif world.spot_offered():
            self.switch(world, SPOT)
        else:
            self.switch(world, None)
            deadline = world.job.deadline_s or 0.0
            self.wake_at(world, deadline - self.remaining_work(world) - 2 * self.d)


class UniformProgress(_DeadlinePolicy):
    name = "uniform-progress"

    def __init__(self, changeover_s: float = d.CHANGEOVER_S.value):
        super().__init__(changeover_s)
        self.safety_net = False

    def _expected(self, world: World, t: float) -> float:
        """ep(t): work (seconds) done by t on the uniform line from 0 to C at the deadline."""
        job = world.job
        total = job.total_steps / job.throughput(1)
        return total * t / (job.deadline_s or 1.0)

    def _done_work(self, world: World) -> float:
        return world.progress / world.job.throughput(1)

    def decide(self, world: World) -> None:
        if world.done:
            return
        job = world.job
        market = self.market(world)
        if self.safety_net:
            self.switch(world, ON_DEMAND)
            return
        if market != SPOT and self.remaining_time(world) < self.remaining_work(world) + 2 * self.d + _EPS:
            self.safety_net = True
            world.log("safety net: on-demand to the end")
            self.switch(world, ON_DEMAND)
            return
        if market == SPOT:
            return  # exploitation: stay on spot until preempted
        cp = self._done_work(world)
        safety_t = (job.deadline_s or 0.0) - self.remaining_work(world) - 2 * self.d
        if market == ON_DEMAND:
            if cp >= self._expected(world, world.now + 2 * self.d) - _EPS:
                self.switch(world, SPOT if world.spot_offered() else None)
                if self.market(world) is None:
                    self.wake_at(world, min(self._catch_up_time(world, cp), safety_t))
                return
            # Hysteresis: stay until cp(t) >= ep(t + 2d); cp grows at 1 s/s once the stall ends.
            k = self._expected(world, 1.0)
            start = max(world.now, world.stalled_until)
            t = (start - cp + 2 * self.d * k) / (1.0 - k) if k < 1 else start
            self.wake_at(world, t)
            return
        if world.spot_offered():
            self.switch(world, SPOT)
        elif cp < self._expected(world, world.now) - _EPS:
            self.switch(world, ON_DEMAND)
            self.decide(world)  # arm the hysteresis timer
        else:
            self.wake_at(world, min(self._catch_up_time(world, cp), safety_t))

    def _catch_up_time(self, world: World, cp: float) -> float:
        """When an idle job falls behind the line: ep(t) = cp."""
        k = self._expected(world, 1.0)
        return cp / k if k > 0 else float("inf")
