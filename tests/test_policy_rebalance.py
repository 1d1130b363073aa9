"""Rebalance policy (issue 5, pure): a recommendation is a risk signal, a notice is a drain."""

from __future__ import annotations

import pytest

from fleetd.policy.model import Drain, Launch, LaunchPurpose, RequestCheckpoint
from fleetd.policy.observation import Observation
from fleetd.policy.planner import plan
from tests.policy_fixtures import A, B, C, NOW, config, node, offer

CFG = config(
    fleet={"min_nodes": 1, "max_nodes": 4},
    rebalance={"max_checkpoint_age_s": 600.0, "max_recommendation_replacements_per_hour": 2,
               "checkpoint_retry_s": 120.0},
    budget={"total_usd": 100.0, "max_usd_per_hour": 20.0},
)
OFFERS = (offer(A, 0.40), offer(B, 0.42), offer(C, 0.45))
AT_RISK = node("i-1", A, rebalance_at=NOW - 30)
HEALTHY = node("i-2", B)


def observe(nodes=(AT_RISK, HEALTHY), **kw) -> Observation:
    base = dict(
        nodes=nodes, offers=OFFERS, target_nodes=2, last_scaling_at=NOW - 10,
        last_durable_checkpoint_step=500, last_durable_checkpoint_at=NOW - 900,
    )
    return Observation(**{**base, **kw})


def test_recommendation_prebuys_elsewhere_and_checkpoints_but_never_drains() -> None:
    result = plan(observe(), CFG, NOW)
    assert result.of_type(Drain) == ()
    (launch,) = result.of_type(Launch)
    assert launch.purpose is LaunchPurpose.REBALANCE_PREBUY and launch.count == 1
    assert A not in launch.pools  # not where the risk is
    assert launch.reason.startswith("rebalance-prebuy: buy 1 spot node(s)")
    (ckpt,) = result.of_type(RequestCheckpoint)
    assert ckpt.reason == (
        "rebalance recommendation: last durable checkpoint 900 s old > max_checkpoint_age_s 600"
    )
    assert "rebalance recommendation for i-1: at risk, kept training until a real notice" in result.notes


@pytest.mark.parametrize(
    ("case", "obs", "launch", "checkpoint", "reason"),
    [
        (
            "fresh checkpoint: none requested",
            observe(last_durable_checkpoint_at=NOW - 100),
            True,
            False,
            "rebalance recommendation: last durable checkpoint 100 s old (<= max_checkpoint_age_s 600), no checkpoint needed",
        ),
        (
            "checkpoint already asked for",
            observe(last_checkpoint_request_at=NOW - 30),
            True,
            False,
            "rebalance recommendation: checkpoint requested 30 s ago, waiting for it",
        ),
        (
            "replacement already bought",
            observe(nodes=(AT_RISK, HEALTHY, node("i-3", C, launched_at=NOW - 20))),
            False,
            True,
            "rebalance recommendation for i-1: at risk",
        ),
        (
            "hourly churn cap used up",
            observe(rebalance_prebuys_last_hour=2),
            False,
            True,
            "not pre-buying 1 replacement(s): 2 pre-buys in the last hour reached "
            "max_recommendation_replacements_per_hour=2",
        ),
        (
            "budget level forbids a pre-buy",
            observe(spent_usd=90.0),
            False,
            True,
            "not pre-buying 1 replacement(s): budget level forbids it",
        ),
        (
            "burn cap leaves no room",
            observe(nodes=(node("i-1", A, price=9.9, rebalance_at=NOW - 30), node("i-2", B, price=9.9))),
            False,
            True,
            "cannot buy 1 spot node(s) (rebalance-prebuy): not even one fits the budget",
        ),
    ],
)
def test_rebalance_policy(case, obs, launch, checkpoint, reason) -> None:
    result = plan(obs, CFG, NOW)
    assert result.of_type(Drain) == (), case
    assert bool(result.of_type(Launch)) is launch, case
    assert bool(result.of_type(RequestCheckpoint)) is checkpoint, case
    assert any(reason in n for n in result.notes), (case, result.notes)


def test_real_notice_drains_before_the_deadline_and_replaces_elsewhere() -> None:
    noticed = node("i-1", A, notice_at=NOW - 5, notice_deadline=NOW + 115, rebalance_at=NOW - 60)
    result = plan(observe(nodes=(noticed, HEALTHY)), CFG, NOW)
    (drain,) = result.of_type(Drain)
    assert drain.instance_id == "i-1" and drain.deadline == NOW + 115
    assert drain.reason == (
        "interruption notice for i-1 (g5.xlarge@us-east-1a) 5 s ago, 115 s before AWS acts: "
        "checkpoint, upload, leave"
    )
    (launch,) = result.of_type(Launch)
    assert launch.purpose is LaunchPurpose.CAPACITY and launch.count == 1 and A not in launch.pools
    # The drain carries the checkpoint; no separate pre-buy or checkpoint request.
    assert result.of_type(RequestCheckpoint) == ()
