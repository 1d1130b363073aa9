"""What fleetd's simulated components report to the planner: the simulator's stand-in for the
daemon's observe step (MQTT intake, signal source, ledger pool history, price source).

A mixin of `fleetd.sim.fleetd_policy.FleetdPolicy` (split from it: one job per module).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from fleetd.policy.memory import PlannerMemory
from fleetd.policy.model import LaunchPurpose, Market, Node, NodePhase, PoolId, PoolOffer
from fleetd.policy.observation import Observation, PoolStats
from fleetd.sim import defaults as d
from fleetd.sim.books import SimNode
from fleetd.sim.engine import ON_DEMAND, World


class ObserveMixin:
    # The state this mixin reads, set up in `FleetdPolicy.__init__` (declarations only).
    pool: PoolId
    od_pool: PoolId
    gpus: int
    startup_s: float
    prior: float | None
    phase: dict[str, NodePhase]
    node_pool: dict[str, PoolId]
    node_purpose: dict[str, LaunchPurpose]
    running_since: dict[str, float]
    drain_started: dict[str, float]
    left_at: dict[str, float]
    throughput: dict[int, float]
    memory: PlannerMemory
    capacity_error_until: float | None
    last_durable_at: float | None
    last_durable_step: int | None
    last_request_at: float | None
    notices: int
    losses: int
    last_notice_at: float | None
    node_s_closed: float

    # What a node's agent reports (the MQTT intake's part of the daemon's Node).
    TELEMETRY_FIELDS = (
        "last_seen_at",
        "notice_at",
        "notice_deadline",
        "gpu_util_pct",
        "steps_per_s",
        "step",
        "running_since",
        "left_at",
    )

    def _node_view(self, world: World, n: SimNode, per_node_rate: float | None, step: int) -> Node:
        phase = self.phase.get(n.id, NodePhase.RUNNING)
        training = phase is NodePhase.RUNNING and n.member
        on_demand = n.market == ON_DEMAND
        return Node(
            instance_id=n.id,
            pool=self.node_pool.get(n.id, self.od_pool if on_demand else self.pool),
            market=Market.ON_DEMAND if on_demand else Market.SPOT,
            price_per_hour=n.price_per_hour,
            launched_at=n.acquired_at,
            phase=phase,
            drain_started_at=self.drain_started.get(n.id),
            last_seen_at=self._last_seen(world, n, phase),
            notice_at=n.notice_at,
            notice_deadline=n.notice_deadline,
            gpu_util_pct=95.0 if training else None,
            steps_per_s=per_node_rate if training else None,
            step=step if n.member else None,  # a draining member trains until it leaves
            running_since=self.running_since.get(n.id),
            left_at=self.left_at.get(n.id),
            launch_purpose=self.node_purpose.get(n.id),
        )

    def _last_seen(self, world: World, n: SimNode, phase: NodePhase) -> float | None:
        """A new node's agent reports once it is up, before it restores and joins training (a
        changeover longer than boot_timeout_s is not a broken boot)."""
        if phase is not NodePhase.PENDING:
            return world.now
        up_after = min(self.startup_s, d.AGENT_UP_S.value)
        return world.now if self.startup_s > 0 and world.now - n.acquired_at >= up_after else None

    def telemetry(self, world: World, node: SimNode) -> dict[str, Any]:
        """What the simulated agent of ``node`` reports (for a daemon-side observer)."""
        w = len(world.members())
        view = self._node_view(world, node, world.job.throughput(w) / w if w else None, int(world.progress))
        return {f: getattr(view, f) for f in self.TELEMETRY_FIELDS}

    def signals(self) -> dict[str, Any]:
        """What the training/checkpoint side reports (SignalSource in the daemon)."""
        return {
            "throughput_by_nodes": MappingProxyType(dict(self.throughput)),
            "last_durable_checkpoint_step": self.last_durable_step,
            "last_durable_checkpoint_at": self.last_durable_at,
            "last_checkpoint_request_at": self.last_request_at,
        }

    def _pool_stats(self, world: World) -> PoolStats:
        """The spot pool's history as the ledger keeps it (spot node-hours, notices, losses)."""
        live_node_s = sum(world.now - n.acquired_at for n in world.held.values() if n.market != ON_DEMAND)
        return PoolStats(
            pool=self.pool,
            node_hours=(self.node_s_closed + live_node_s) / 3600.0,
            notices=self.notices,
            losses=self.losses,
            capacity_error_until=self.capacity_error_until,
            last_notice_at=self.last_notice_at,
            prior_interruptions_per_hour=self.prior,
        )

    def _observe(self, world: World) -> Observation:
        members = world.members()
        if members:
            self.throughput[len(members)] = world.job.throughput(len(members))
        w = len(members)
        rate = world.job.throughput(w) / w if w else None
        step = int(world.progress)
        nodes = [self._node_view(world, n, rate, step) for n in world.held.values()]
        stats = self._pool_stats(world)
        offers = (
            PoolOffer(
                pool=self.pool,
                gpus=self.gpus,
                spot_price=world.spot_price,
                on_demand_price=world.on_demand_price,
            ),
            PoolOffer(pool=self.od_pool, gpus=self.gpus, spot_price=None, on_demand_price=world.on_demand_price),
        )
        m = self.memory
        return Observation(
            nodes=tuple(nodes),
            offers=offers,
            pool_stats=(stats,),
            spent_usd=world.spent_usd(),
            **self.signals(),
            target_nodes=m.target_nodes,
            last_scaling_at=m.last_scaling_at,
            spot_unavailable_since=m.spot_unavailable_since,
            stop_issued_at=m.stop_issued_at,
            budget_level=m.budget_level,
            job_started_at=0.0,  # the simulated job starts at the trace's (virtual) time 0
        )
