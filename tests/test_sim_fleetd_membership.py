"""How the simulator carries out fleetd's membership changes (fleetd/sim/fleetd_policy.py).

- A reclaim wave's notices (same instant) wake one planner pass: its drains leave in one
  rendezvous round (one checkpoint, one re-form), not one round per node.
- A drained node reports that its trainer exited (left_at) after its checkpoint, shard upload and
  leave; the planner terminates it then, so it stops billing; without that report it is billed
  until AWS reclaims it.
- After a loss without notice the survivors hang only until the rendezvous steering drops the
  silent rank, then re-form.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetd.config import BudgetConfig, CapacityConfig, FleetConfig, FleetdConfig
from fleetd.policy.model import PoolId
from fleetd.sim import defaults as d
from fleetd.sim.engine import World
from fleetd.sim.fleetd_policy import FleetdPolicy
from fleetd.sim.job import JobSpec
from fleetd.sim.traces import read_availability_json

POOL = PoolId("g4dn.xlarge", "us-east-1a")
REFORM, STALL = 5.0, 5.0


def _run(tmp_path: Path, no_notice_share: float, leaving_signal: bool = True) -> tuple[World, FleetdPolicy]:
    # 4 nodes for 20 min, then 3 of them reclaimed at once (1 left for 20 min); no on-demand.
    trace = read_availability_json(json.dumps({"metadata": {"gap_seconds": 60}, "data": [4] * 20 + [1] * 20}), "count")
    cfg = FleetdConfig(
        fleet=FleetConfig(name="m", min_nodes=1, max_nodes=4, state_dir=tmp_path),
        capacity=CapacityConfig(instance_types=("g4dn.xlarge",), allow_on_demand=False),
        budget=BudgetConfig(total_usd=10_000.0, max_usd_per_hour=100.0),
    )
    job = JobSpec(total_steps=1e9, max_nodes=4, checkpoint_stall_s=STALL, checkpoint_gb=10.0,
                  no_notice_share=no_notice_share)
    world = World(trace, job, 0.2, 0.5, seed=1)
    policy = FleetdPolicy(cfg, POOL, reform_s=REFORM, leaving_signal=leaving_signal)
    world.run(policy)
    return world, policy


def test_a_reclaim_wave_drains_together_and_each_node_is_terminated_once_it_has_left(tmp_path) -> None:
    world, policy = _run(tmp_path, no_notice_share=0.0)
    notice_at = 1200.0 - d.NOTICE_LEAD_S.value
    drains = [r for r in policy.record if r.kind == "Drain"]
    assert len(drains) == 3 and {r.t for r in drains} == {notice_at}
    # One round: one checkpoint stall, then one re-form, for the survivor (the leavers' time is
    # idle from the drain on); plus the first round at t=0, when the 4 nodes joined.
    assert world.overhead["checkpoint"] == pytest.approx(1 * STALL)
    assert world.overhead["re-form"] == pytest.approx(4 * REFORM + 1 * REFORM)
    # Left after checkpoint + upload of its shard (10 GB / 4 ranks at UPLOAD_GB_PER_S) + leave.
    left_after = STALL + 10.0 / 4 / d.UPLOAD_GB_PER_S.value + REFORM
    terminates = [r for r in policy.record if r.kind == "Terminate"]
    assert sorted(r.detail for r in terminates) == sorted(r.detail for r in drains)
    assert [r.t for r in terminates] == pytest.approx([notice_at + left_after] * 3)
    assert world.overhead["idle (held, not training)"] == pytest.approx(3 * left_after)


def test_without_the_left_report_a_drained_node_is_billed_until_reclaimed(tmp_path) -> None:
    world, policy = _run(tmp_path, no_notice_share=0.0, leaving_signal=False)
    assert not [r for r in policy.record if r.kind == "Terminate"]
    assert world.overhead["idle (held, not training)"] == pytest.approx(3 * d.NOTICE_LEAD_S.value)


def test_survivors_of_a_silent_loss_hang_until_the_rendezvous_drops_the_dead_ranks(tmp_path) -> None:
    world, _ = _run(tmp_path, no_notice_share=1.0)
    assert world.unannounced == 3
    assert world.overhead["loss recovery"] == pytest.approx(1 * (d.FLEETD_RDZV_DEAD_AFTER_S.value + REFORM))
    assert world.overhead["lost work"] > 0  # rolled back to the last checkpoint
