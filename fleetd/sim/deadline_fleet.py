"""Can't Be Late's deadline baselines for a fleet of N nodes (policies.py has the single-node ones).

Each is extended to N nodes the plain way, with the mechanics every elastic job (and fleetd) has:
a node bought now pays the changeover d before it joins, a loss leaves the job at the smaller
size, and a loss stalls the members for ``reform_s`` (a join for ``join_reform_s``). Work is in seconds at size N.
`FleetGreedy`: spot when offered; safety net (time left <= work left + 2d): on-demand to the end.
`FleetUniformProgress`: also on-demand for the empty slots while behind the line C x t / D, kept
until 2d ahead (docs/DESIGN.md "Placement and deadlines").
"""

from __future__ import annotations

from fleetd.sim.books import SimNode
from fleetd.sim.engine import ON_DEMAND, SPOT, World
from fleetd.sim.policies import DeadlineCallbacks

_EPS = 1e-3


class _FleetDeadline(DeadlineCallbacks):
    def __init__(self, changeover_s: float, reform_s: float = 0.0, join_reform_s: float | None = None) -> None:
        super().__init__(changeover_s)
        self.reform_s = reform_s
        self.join_reform_s = reform_s if join_reform_s is None else join_reform_s
        self._joined: set[str] = set()
        self.safety_net = False

    # --- quantities in seconds of work at the full size ------------------------------------
    def rate(self, world: World) -> float:
        return world.job.throughput(world.job.max_nodes)

    def remaining_work(self, world: World) -> float:
        return world.remaining_steps / self.rate(world)

    def expected(self, world: World, t: float) -> float:
        job = world.job
        return job.total_steps / self.rate(world) * t / (job.deadline_s or 1.0)

    def done(self, world: World) -> float:
        return world.progress / self.rate(world)

    def nodes(self, world: World, market: str) -> list[SimNode]:
        return [n for n in world.held.values() if n.market == market]

    # --- buying and releasing ---------------------------------------------------------------
    def buy(self, world: World, market: str, count: int) -> None:
        if count <= 0:
            return
        got = world.acquire_spot(count) if market == SPOT else world.acquire_on_demand(count)
        if got:
            world.log(f"buy {len(got)} {market}")
            world.after(self.d, lambda: self._join(world, got))

    def _join(self, world: World, nodes: list[SimNode]) -> None:
        alive = [n for n in nodes if world.held.get(n.id) is n]
        if alive and not world.done:
            before = world.members()
            world.set_members(before + alive)
            self._joined.update(n.id for n in alive)
            if before:
                world.stall(self.join_reform_s, "re-form", after_current=True, detail="join")
            # The pace changed: re-decide (UP's hysteresis end is computed from the members'
            # pace; without this a fleet whose on-demand nodes were still booting at the last
            # decision kept them until the next capacity event, hours later on a quiet trace).
            self.decide(world)

    def release(self, world: World, nodes: list[SimNode]) -> None:
        for node in nodes:
            world.release(node)
        if nodes:
            world.log(f"release {len(nodes)} {nodes[0].market}")
            self._left(world, nodes)

    def _left(self, world: World, nodes: list[SimNode]) -> None:
        """Members left: the survivors re-form (one round for nodes that leave together)."""
        if any(n.id in self._joined for n in nodes) and world.members():
            world.stall(self.reform_s, "re-form", after_current=True, detail="leave")
        self._joined.difference_update(n.id for n in nodes)

    def slots(self, world: World) -> int:
        return world.job.max_nodes - len(world.held)

    def forced(self, world: World) -> bool:
        full_on_spot = len(self.nodes(world, SPOT)) >= world.job.max_nodes
        return not full_on_spot and self.remaining_time(world) < self.remaining_work(world) + 2 * self.d + _EPS

    def finish_on_demand(self, world: World) -> None:
        if not self.safety_net:
            self.safety_net = True
            world.log("safety net: on-demand to the end")
        self.buy(world, ON_DEMAND, self.slots(world))

    def safety_at(self, world: World) -> float:
        return (world.job.deadline_s or 0.0) - self.remaining_work(world) - 2 * self.d

    def finished_or_finishing(self, world: World) -> bool:
        """Done, or inside the safety net (entered now or before): on-demand to the end."""
        if world.done:
            return True
        if self.safety_net or self.forced(world):
            self.finish_on_demand(world)
            return True
        return False

    def on_lost(self, world: World, node: SimNode, noticed: bool) -> None:
        self._left(world, [node])
        super().on_lost(world, node, noticed)


class FleetGreedy(_FleetDeadline):
    name = "greedy"

    def decide(self, world: World) -> None:
        if self.finished_or_finishing(world):
            return
        self.buy(world, SPOT, self.slots(world))
        if self.safety_at(world) > world.now:  # (past it while full on spot: a loss wakes it)
            self.wake_at(world, self.safety_at(world))


class FleetUniformProgress(_FleetDeadline):
    name = "uniform-progress"

    def decide(self, world: World) -> None:
        if self.finished_or_finishing(world):
            return
        cp = self.done(world)
        on_demand = self.nodes(world, ON_DEMAND)
        if on_demand and cp >= self.expected(world, world.now + 2 * self.d) - _EPS:
            self.release(world, on_demand)  # well ahead: back to spot where offered, else idle
        self.buy(world, SPOT, self.slots(world))
        if self.slots(world) and cp < self.expected(world, world.now) - _EPS:
            self.buy(world, ON_DEMAND, self.slots(world))
        times = [self.safety_at(world)]
        k = self.expected(world, 1.0)
        if k > 0:
            # When an idle job falls behind the line by the tolerance above. This was cp / k, the
            # crossing itself, which is now for a job on the line (at its start) and was dropped
            # below: a fleet that found no spot at its start waited for the next world event
            # (the capacity retry, 600 s) instead of buying on-demand as its rule says and the
            # one-node UP does.
            times.append((cp + 2 * _EPS) / k)
        if self.nodes(world, ON_DEMAND):
            # When the hysteresis ends at the current pace (cp grows at rate(w)/rate(N) per s).
            pace = world.job.throughput(len(world.members())) / self.rate(world)
            if pace > k:
                times.append((2 * self.d * k - cp + pace * world.now) / (pace - k))
        times = [t for t in times if t > world.now]
        if times:
            self.wake_at(world, min(times))
