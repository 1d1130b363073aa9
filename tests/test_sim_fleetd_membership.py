"""How the simulator carries out fleetd's membership changes (fleetd/sim/fleetd_policy.py).

- A reclaim wave's notices (same instant) wake one planner pass: its drains leave in one
  rendezvous round (one checkpoint, one re-form), not one round per node.
- A drained node reports that its trainer exited (left_at) after its checkpoint, shard upload and
  leave; the planner terminates it then, so it stops billing; without that report it is billed
  until AWS reclaims it.
- After a loss without notice the survivors hang only until the rendezvous steering drops the
  silent rank and pokes them; they save the step they completed (only the step in flight is
  lost), then re-form. With sharded state, or no survivor, the job rolls back instead.
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


def _run(
    tmp_path: Path,
    no_notice_share: float,
    leaving_signal: bool = True,
    salvage_loss_s: float | None = d.SALVAGE_STEP_LOSS_S.value,
    left_after_wave: int = 1,
    join_reform_s: float | None = None,
) -> tuple[World, FleetdPolicy]:
    # 4 nodes for 20 min, then 3 of them (or all 4) reclaimed at once; no on-demand.
    data = [4] * 20 + [left_after_wave] * 20
    trace = read_availability_json(json.dumps({"metadata": {"gap_seconds": 60}, "data": data}), "count")
    cfg = FleetdConfig(
        fleet=FleetConfig(name="m", min_nodes=1, max_nodes=4, state_dir=tmp_path),
        capacity=CapacityConfig(instance_types=("g4dn.xlarge",), on_demand="never"),
        budget=BudgetConfig(total_usd=10_000.0, max_usd_per_hour=100.0),
    )
    job = JobSpec(
        total_steps=1e9, max_nodes=4, checkpoint_stall_s=STALL, checkpoint_gb=10.0, no_notice_share=no_notice_share
    )
    world = World(trace, job, 0.2, 0.5, seed=1)
    policy = FleetdPolicy(
        cfg,
        POOL,
        reform_s=REFORM,
        join_reform_s=join_reform_s,
        leaving_signal=leaving_signal,
        salvage_loss_s=salvage_loss_s,
    )
    world.run(policy)
    return world, policy


@pytest.mark.parametrize("sharded", [False, True])
def test_a_reclaim_wave_drains_together_and_each_node_is_terminated_once_it_has_left(tmp_path, sharded) -> None:
    salvage_loss_s = None if sharded else d.SALVAGE_STEP_LOSS_S.value
    world, policy = _run(tmp_path, no_notice_share=0.0, salvage_loss_s=salvage_loss_s)
    notice_at = 1200.0 - d.NOTICE_LEAD_S.value
    drains = [r for r in policy.record if r.kind == "Drain"]
    assert len(drains) == 3 and {r.t for r in drains} == {notice_at}
    # One round: one checkpoint stall, then one re-form, for the survivor (the leavers' time is
    # idle from the drain on); plus the first round at t=0, when the 4 nodes joined.
    assert world.overhead["checkpoint"] == pytest.approx(1 * STALL)
    assert world.overhead["re-form"] == pytest.approx(4 * REFORM + 1 * REFORM)
    if sharded:  # left after its save + the upload of its shard (10 GB / 4 ranks) + the leave
        left_after = STALL + 10.0 / 4 / d.UPLOAD_GB_PER_S.value + REFORM
    else:  # replicated, a node stays: it stops at the hold and leaves (agent/trainer/hold_plan.py)
        left_after = REFORM
    terminates = [r for r in policy.record if r.kind == "Terminate"]
    assert sorted(r.detail for r in terminates) == sorted(r.detail for r in drains)
    assert [r.t for r in terminates] == pytest.approx([notice_at + left_after] * 3)
    assert world.overhead["idle (held, not training)"] == pytest.approx(3 * left_after)


def test_a_join_round_and_a_leave_round_are_timed_and_broken_down_apart(tmp_path) -> None:
    join = 6.5
    world, _ = _run(tmp_path, no_notice_share=0.0, join_reform_s=join)
    # The 4 nodes' first round is a join; the wave's round a leave (one survivor).
    assert world.breakdown["re-form: join"] == pytest.approx(4 * join)
    assert world.breakdown["re-form: leave"] == pytest.approx(1 * REFORM)
    assert world.breakdown["checkpoint: before a leave"] == pytest.approx(1 * STALL)
    # The breakdown splits the overhead, reason by reason, and loses nothing.
    for reason, node_s in world.overhead.items():
        parts = [v for k, v in world.breakdown.items() if k == reason or k.startswith(reason + ": ")]
        assert sum(parts) == pytest.approx(node_s)
    assert sum(world.breakdown.values()) == pytest.approx(sum(world.overhead.values()))


def test_without_the_left_report_a_drained_node_is_billed_until_reclaimed(tmp_path) -> None:
    world, policy = _run(tmp_path, no_notice_share=0.0, leaving_signal=False)
    assert not [r for r in policy.record if r.kind == "Terminate"]
    assert world.overhead["idle (held, not training)"] == pytest.approx(3 * d.NOTICE_LEAD_S.value)


def test_survivors_of_a_silent_loss_hang_until_poked_then_save_the_step_they_completed(tmp_path) -> None:
    world, _ = _run(tmp_path, no_notice_share=1.0)
    assert world.unannounced == 3
    # One survivor: hangs until the steering pokes it, saves, re-forms.
    assert world.overhead["loss recovery"] == pytest.approx(1 * (d.FLEETD_SILENT_LOSS_HANG_S.value + REFORM))
    assert world.overhead["checkpoint"] == pytest.approx(1 * STALL)  # the survivor's save
    assert world.breakdown["loss recovery: hang until the survivors are poked"] == pytest.approx(
        d.FLEETD_SILENT_LOSS_HANG_S.value
    )
    assert world.breakdown["checkpoint: salvage after a silent loss"] == pytest.approx(STALL)
    # Only the step in flight is lost: SALVAGE_STEP_LOSS_S of the 4 ranks' work, not 20 min.
    lost_s = d.SALVAGE_STEP_LOSS_S.value
    assert world.steps_lost == pytest.approx(world.job.throughput(4) * lost_s)
    assert world.overhead["lost work"] == pytest.approx(4 * lost_s)


def test_with_sharded_state_a_silent_loss_rolls_back_to_the_last_checkpoint(tmp_path) -> None:
    world, _ = _run(tmp_path, no_notice_share=1.0, salvage_loss_s=None)
    # No checkpoint since the nodes joined at t=0: all 20 minutes of 4 nodes' work are lost.
    assert world.overhead["lost work"] == pytest.approx(4 * (1200.0 - REFORM))
    assert "checkpoint" not in world.overhead


def test_a_wave_that_takes_every_member_leaves_nobody_to_save(tmp_path) -> None:
    world, _ = _run(tmp_path, no_notice_share=1.0, left_after_wave=0)
    assert world.unannounced == 4
    assert world.overhead["lost work"] == pytest.approx(4 * (1200.0 - REFORM))


def test_the_silent_loss_hang_is_the_daemons_own_config_default() -> None:
    # The simulator charges what the daemon's steering waits (fleetd.toml [loss]): a member quiet
    # on the store and the broker for silent_after_s while the job stands still is dropped, all
    # counted from the loss at the latest.
    from fleetd.config import LossConfig

    loss = LossConfig()
    assert d.FLEETD_SILENT_LOSS_HANG_S.value == loss.silent_after_s == 2.5
    assert "silent_after_s" in d.FLEETD_SILENT_LOSS_HANG_S.source


def test_a_node_bought_inside_its_notice_window_never_joins_and_leaves_at_once(tmp_path) -> None:
    # Two nodes all along; a third is offered from minute 5 and reclaimed at minute 11. fleetd's
    # capacity retry buys it at 600 s, inside its notice window (660 - 120 s): its agent sees the
    # notice before it starts a trainer (DESIGN.md "A wave of notices"), so nobody checkpoints or
    # re-forms for it, and it is terminated once it says it left.
    data = [2] * 5 + [3] * 6 + [2] * 9
    trace = read_availability_json(json.dumps({"metadata": {"gap_seconds": 60}, "data": data}), "count")
    cfg = FleetdConfig(
        fleet=FleetConfig(name="m", min_nodes=1, max_nodes=3, state_dir=tmp_path),
        capacity=CapacityConfig(instance_types=("g4dn.xlarge",), on_demand="never"),
        budget=BudgetConfig(total_usd=10_000.0, max_usd_per_hour=100.0),
    )
    job = JobSpec(total_steps=1e9, max_nodes=3, checkpoint_stall_s=STALL, checkpoint_gb=10.0, no_notice_share=0.0)
    world = World(trace, job, 0.2, 0.5, seed=1)
    policy = FleetdPolicy(cfg, POOL, reform_s=REFORM)
    world.run(policy)
    assert world.actions == ["0s launch 2 spot", "600s launch 1 spot"]
    drains = [r for r in policy.record if r.kind == "Drain"]
    terminates = [r for r in policy.record if r.kind == "Terminate"]
    assert [r.detail for r in terminates] == [r.detail for r in drains] == ["trace-n3"]
    assert [r.t for r in terminates] == pytest.approx([600.0], abs=0.01)
    assert world.notices == 1
    # Only the first round (two nodes at t=0): no checkpoint, no second re-form.
    assert world.overhead["re-form"] == pytest.approx(2 * REFORM)
    assert "checkpoint" not in world.overhead
    assert world.overhead["minimum charge"] == pytest.approx(d.MIN_CHARGE_S.value)
