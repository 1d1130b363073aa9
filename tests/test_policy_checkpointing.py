"""Periodic checkpoints at the Young/Daly interval for the fleet's own losses without notice."""

from __future__ import annotations

import math

import pytest

from fleetd.policy.checkpointing import cadence, young_daly_interval_s
from fleetd.policy.model import RequestCheckpoint
from fleetd.policy.observation import Observation, PoolStats
from fleetd.policy.planner import plan
from tests.policy_fixtures import NOW, A, config, node, offer

YD = {"young_daly_checkpoints": True, "checkpoint_stall_s": 5.0}


def _obs(losses: int, durable_age: float, **kw) -> Observation:
    return Observation(
        nodes=tuple(node(f"i-{i}") for i in range(4)),
        offers=(offer(A, 0.4),),
        pool_stats=(PoolStats(A, node_hours=40.0, losses=losses),),
        target_nodes=4,
        last_scaling_at=NOW,
        last_durable_checkpoint_step=100,
        last_durable_checkpoint_at=NOW - durable_age,
        **kw,
    )


def test_cadence_is_young_daly_for_the_fleets_rate_of_silent_losses() -> None:
    # 4 losses in 40 node-h: one per 10 node-h; 4 nodes training: one every 9,000 s.
    c = cadence((PoolStats(A, node_hours=40.0, losses=4),), 4, 5.0)
    assert c.interval_s == pytest.approx(young_daly_interval_s(5.0, 9000.0)) == pytest.approx(300.0)
    assert cadence((PoolStats(A, node_hours=40.0),), 4, 5.0).interval_s == math.inf


def test_a_checkpoint_older_than_the_interval_is_requested_with_its_reason() -> None:
    cfg = config(fleet={"max_nodes": 4}, rebalance=YD)
    (ckpt,) = plan(_obs(losses=4, durable_age=301.0), cfg, NOW).actions
    assert isinstance(ckpt, RequestCheckpoint)
    assert ckpt.reason == (
        "periodic checkpoint: 4 losses without notice in 40.0 node-h, 4 nodes training: one every "
        "9000 s; Young/Daly sqrt(2 x 5 s x 9000 s) = 300 s; the last durable one is 301 s old"
    )


@pytest.mark.parametrize(
    ("why", "losses", "age", "cfg_rebalance", "extra"),
    [
        ("young enough", 4, 299.0, YD, {}),
        ("no silent loss seen", 0, 5000.0, YD, {}),
        ("off by default", 4, 5000.0, {}, {}),
        ("one is in flight", 4, 400.0, YD, {"last_checkpoint_request_at": NOW - 30}),
    ],
)
def test_no_periodic_checkpoint(why, losses, age, cfg_rebalance, extra) -> None:
    cfg = config(fleet={"max_nodes": 4}, rebalance=cfg_rebalance)
    assert plan(_obs(losses, age, **extra), cfg, NOW).actions == (), why
