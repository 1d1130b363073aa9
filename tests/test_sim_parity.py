"""The simulator and the daemon share the planner: the same scenario, run through the simulator
and through the reconcile loop (fleetd/reconcile/loop.py) against fakes, gives the same actions.

Lockstep: at every pass of the simulator, the loop runs one pass at the same virtual time on its
own state: the in-memory EC2 (fleetd/adapters/ec2_fake.py), its SQLite state store, a price source
and an observer that reports what the simulated agents report (notices, telemetry). What the
loop knows it must have learned itself through its adapters and state: which instances exist
(its own launches), which were reclaimed, capacity errors and their TTL, drains in progress,
notices recorded, spot unavailability, the target it remembered. Both sides' actions are
compared pass by pass (instance ids mapped by launch order).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from fleetd.adapters.ec2_fake import FakeEc2
from fleetd.adapters.pricing import Hardware, PoolPrice
from fleetd.config import BudgetConfig, CapacityConfig, FleetConfig, FleetdConfig
from fleetd.policy.model import Drain, Launch, MarkPoolUnavailable, Node, PoolId, Terminate, Warn
from fleetd.policy.planner import plan
from fleetd.reconcile.build import ledger_beside
from fleetd.reconcile.loop import Reconciler
from fleetd.reconcile.ports import FleetSignals
from fleetd.reconcile.state import StateStore
from fleetd.sim.engine import World
from fleetd.sim.fleetd_policy import FleetdPolicy
from fleetd.sim.job import JobSpec
from fleetd.sim.traces import read_availability_json

SPOT_POOL = PoolId("g4dn.xlarge", "us-east-1a")
OD_POOL = PoolId("g4dn.xlarge", "us-east-1b")  # on-demand only (no spot price offered there)
SPOT, OD = 0.2206, 0.526


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Prices:
    async def prices(self, pools, now):
        table = {SPOT_POOL: PoolPrice(SPOT_POOL, SPOT, OD), OD_POOL: PoolPrice(OD_POOL, None, OD)}
        return {p: table[p] for p in pools if p in table}


class Lockstep:
    """Runs the loop beside the simulator and keeps both sides' actions."""

    def __init__(self, tmp_path: Path, cfg: FleetdConfig, world: World) -> None:
        self.world = world
        self.clock = Clock()
        # The fake's shortage (``no_capacity``) refuses on-demand launches in the spot pool too: the
        # loop must remember that apart from spot, or it blocks spot there (parity would break).
        self.ec2 = FakeEc2(self.clock)
        self.od_capacity_errors = 0  # on-demand capacity errors the loop recorded
        self.aio = asyncio.new_event_loop()
        self.state = self.aio.run_until_complete(StateStore.open(tmp_path))
        self.policy: FleetdPolicy | None = None
        self.sim_of: dict[str, str] = {}  # loop instance id -> simulator node id
        self.sim_actions: list[tuple] = []
        self.loop_actions: list[tuple] = []
        self.reconciler = Reconciler(
            cfg,
            ec2=self.ec2,
            prices=Prices(),
            state=self.state,
            pools=(SPOT_POOL, OD_POOL),
            hardware={"g4dn.xlarge": Hardware(1, "T4", 16.0)},
            planner=plan,
            clock=self.clock,
            signals=self,
            observer=self,
            ledger=self.aio.run_until_complete(ledger_beside(self.state)),
        )

    # NodeObserver / SignalSource: what the simulated agents and checkpoint side report.
    def track(self, instance_id: str) -> None:
        pass

    def observe(self, node: Node) -> Node:
        sim_node = self.world.held.get(self.sim_of.get(node.instance_id, ""))
        if sim_node is None:
            return node
        return replace(node, **self.policy.telemetry(self.world, sim_node))

    def snapshot(self) -> FleetSignals:
        return FleetSignals(**self.policy.signals())

    def _sync(self, now: float) -> None:
        self.clock.t = now
        mapped = set(self.sim_of.values())
        new_sim = [n for n in self.world.held.values() if n.id not in mapped]
        new_loop = sorted(i for i in self.ec2.instances if i not in self.sim_of)
        assert len(new_sim) == len(new_loop), "both sides bought the same number of nodes"
        self.sim_of.update(zip(new_loop, (n.id for n in new_sim), strict=True))
        for iid, sim_id in self.sim_of.items():
            inst = self.ec2.instances[iid]
            if sim_id not in self.world.held and inst.state != "terminated":
                self.ec2.interrupt(iid)  # AWS reclaimed it in the trace
        if self.world.free_spot():
            self.ec2.no_capacity.pop(SPOT_POOL, None)
        else:
            self.ec2.no_capacity[SPOT_POOL] = "InsufficientInstanceCapacity"

    def _norm(self, action, ids: dict[str, str]) -> tuple:
        if isinstance(action, Launch):
            return ("Launch", action.count, action.market.value, action.purpose.value)
        if isinstance(action, (Drain, Terminate)):
            return (type(action).__name__, ids.get(action.instance_id, action.instance_id))
        if isinstance(action, MarkPoolUnavailable):
            return ("MarkPoolUnavailable", str(action.pool))
        if isinstance(action, Warn):
            return ("Warn", action.code)
        return (type(action).__name__,)

    def planner(self, obs, cfg, now):
        """The simulator's planner hook: first the loop's pass at ``now``, then the real plan."""
        self._sync(now)
        report = self.aio.run_until_complete(self.reconciler.run_pass())
        assert report.error is None
        self.loop_actions += [(now, self._norm(a, self.sim_of)) for a in report.plan.actions]
        result = plan(obs, cfg, now)
        self.sim_actions += [(now, self._norm(a, {})) for a in result.actions]
        return result

    def close(self) -> None:
        stats = self.aio.run_until_complete(self.state.pool_stats())
        self.od_capacity_errors = sum(s.on_demand_capacity_error_until is not None for s in stats)
        self.aio.run_until_complete(self.state.close())
        self.aio.close()


def _trace(counts, gap=60.0):
    return read_availability_json(json.dumps({"metadata": {"gap_seconds": gap}, "data": counts}), "count")


@pytest.mark.parametrize(
    "no_notice_share",
    [0.0, 1.0],
    ids=["losses-with-notice", "losses-without-notice"],
)
def test_simulator_and_reconcile_loop_take_the_same_actions(tmp_path: Path, no_notice_share: float) -> None:
    # 3 spot nodes; one reclaimed at 20 min; spot capacity gone until 60 min (on-demand
    # fallback after spot_wait_s), then back (return to spot); a second loss at 90 min.
    trace = _trace([3] * 20 + [2] * 40 + [3] * 30 + [2] * 40)
    cfg = FleetdConfig(
        fleet=FleetConfig(name="parity", min_nodes=1, max_nodes=3, state_dir=tmp_path, reconcile_interval_s=10.0),
        capacity=CapacityConfig(
            instance_types=("g4dn.xlarge",),
            zones=("us-east-1a", "us-east-1b"),
            spot_wait_s=300.0,
            on_demand="hold_size",
            cross_az_penalty=0.0,
            capacity_error_ttl_s=240.0,
            interrupting_window_s=300.0,
        ),
        budget=BudgetConfig(total_usd=10_000.0, max_usd_per_hour=100.0),
    )
    job = JobSpec(total_steps=1e9, max_nodes=3, checkpoint_stall_s=5.0, no_notice_share=no_notice_share)
    world = World(trace, job, SPOT, OD, seed=1)
    lock = Lockstep(tmp_path, cfg, world)
    policy = FleetdPolicy(cfg, SPOT_POOL, od_pool=OD_POOL, planner=lock.planner, tick_s=60.0)
    lock.policy = policy
    try:
        result = world.run(policy)
    finally:
        lock.close()

    assert lock.sim_actions == lock.loop_actions
    kinds = [a for _, a in lock.sim_actions]
    # The scenario exercised the interesting paths, not just a quiet fleet.
    assert ("Launch", 3, "spot", "capacity") in kinds
    assert ("Launch", 1, "on-demand", "on-demand-fallback") in kinds
    assert ("Launch", 1, "spot", "return-to-spot") in kinds
    assert lock.od_capacity_errors >= 1  # the on-demand fallback met the shortage too
    if no_notice_share == 0.0:
        assert any(k[0] == "Drain" for k in kinds)
        assert result.notices >= 2
        # Each drained node reported that it left (registry left_at through the observer) and
        # both sides terminated it on that report, long before its notice deadline or timeout.
        for t, action in lock.sim_actions:
            if action[0] == "Drain":
                ended = [u for u, a in lock.sim_actions if a == ("Terminate", action[1]) and u >= t]
                assert ended and ended[0] - t < 60.0, action
    else:
        assert result.losses_without_notice >= 2
    assert len(policy.pass_times) > 20
