"""Rebalance policy (issue 5, pure): a recommendation is a risk signal, a notice is a drain."""

from __future__ import annotations

import pytest

from fleetd.policy.model import Drain, Launch, LaunchPurpose, NodePhase, RequestCheckpoint, Terminate
from fleetd.policy.observation import Observation
from fleetd.policy.planner import plan
from fleetd.policy.rebalance import prebought_for
from tests.policy_fixtures import NOW, A, B, C, config, node, offer

CFG = config(
    fleet={"min_nodes": 1, "max_nodes": 4},
    rebalance={
        "max_checkpoint_age_s": 600.0,
        "max_recommendation_replacements_per_hour": 2,
        "checkpoint_retry_s": 120.0,
    },
    budget={"total_usd": 100.0, "max_usd_per_hour": 20.0},
)
OFFERS = (offer(A, 0.40), offer(B, 0.42), offer(C, 0.45))
AT_RISK = node("i-1", A, rebalance_at=NOW - 30)
HEALTHY = node("i-2", B)


def observe(nodes=(AT_RISK, HEALTHY), **kw) -> Observation:
    base = dict(
        nodes=nodes,
        offers=OFFERS,
        target_nodes=2,
        last_scaling_at=NOW - 10,
        last_durable_checkpoint_step=500,
        last_durable_checkpoint_at=NOW - 900,
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
    assert ckpt.reason == ("rebalance recommendation: last durable checkpoint 900 s old > max_checkpoint_age_s 600")
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
        "interruption notice for i-1 (g5.xlarge@us-east-1a) 5 s ago, 115 s before AWS acts: checkpoint, upload, leave"
    )
    (launch,) = result.of_type(Launch)
    assert launch.purpose is LaunchPurpose.CAPACITY and launch.count == 1 and A not in launch.pools
    # The drain carries the checkpoint; no separate pre-buy or checkpoint request.
    assert result.of_type(RequestCheckpoint) == ()


# ---------------------------------------------------------------- the advice expires
WINDOW = CFG.rebalance.recommendation_expiry_s
PREBOUGHT = node("i-3", C, launched_at=NOW - WINDOW + 60)  # bought a minute after the advice


def at_risk_since(age_s: float, **kw):
    return node("i-1", A, rebalance_at=NOW - age_s, **kw)


def test_within_the_window_the_prebought_node_is_kept_and_scaling_holds() -> None:
    risky = at_risk_since(WINDOW - 1)
    result = plan(observe(nodes=(risky, HEALTHY, PREBOUGHT)), CFG, NOW)
    assert result.of_type(Drain) == () and result.of_type(Terminate) == ()
    assert any("at risk" in n for n in result.notes)


def test_advice_with_no_notice_expires_and_releases_the_node_it_prebought() -> None:
    risky = at_risk_since(WINDOW + 1)
    result = plan(observe(nodes=(risky, HEALTHY, PREBOUGHT)), CFG, NOW)
    (drain,) = result.of_type(Drain)
    assert drain.instance_id == "i-3"  # the extra node, not the once-risky one
    assert "pre-bought for a rebalance recommendation that expired" in drain.reason
    assert any(
        f"expired: no notice within recommendation_expiry_s={WINDOW:.0f}" in n
        and "releasing the extra node it caused (i-3)" in n
        for n in result.notes
    )
    assert result.of_type(Launch) == ()  # no new pre-buy for expired advice


def test_the_release_follows_the_launch_purpose_not_the_launch_order() -> None:
    """A scale-up bought in the same second as the pre-buy (EC2's LaunchTime has whole seconds)
    and listed as newer: the recorded purpose says which node the expired advice caused."""
    prebuy = node("i-3", C, launched_at=NOW - WINDOW + 60, launch_purpose=LaunchPurpose.REBALANCE_PREBUY)
    scale_up = node("i-4", B, launched_at=NOW - WINDOW + 60, launch_purpose=LaunchPurpose.CAPACITY)
    risky = at_risk_since(WINDOW + 1)
    assert prebought_for((risky,), [risky, HEALTHY, prebuy, scale_up]) == {"i-3"}
    # A node bought for capacity is never taken for a pre-buy, however new.
    assert prebought_for((risky,), [risky, HEALTHY, scale_up]) == frozenset()
    # Unknown purpose (bought before the state recorded launches): launch order decides, a known
    # pre-buy still wins over it.
    unknown = node("i-5", B, launched_at=NOW - WINDOW + 90)
    assert prebought_for((risky,), [risky, HEALTHY, unknown]) == {"i-5"}
    assert prebought_for((risky,), [risky, HEALTHY, unknown, prebuy]) == {"i-3"}


def test_a_prebought_node_not_yet_training_is_released_at_once() -> None:
    pending = node("i-3", C, launched_at=NOW - 30, phase=NodePhase.PENDING, util=None, sps=None)
    risky = node("i-1", A, rebalance_at=NOW - WINDOW - 40)
    result = plan(observe(nodes=(risky, HEALTHY, pending)), CFG, NOW)
    assert [t.instance_id for t in result.of_type(Terminate)] == ["i-3"]


def test_the_prebought_node_stays_when_it_replaces_the_risky_one() -> None:
    """A notice after all (even past the window): the pre-bought node is the replacement."""
    noticed = at_risk_since(WINDOW + 100, notice_at=NOW - 5, notice_deadline=NOW + 115)
    result = plan(observe(nodes=(noticed, HEALTHY, PREBOUGHT)), CFG, NOW)
    assert [d.instance_id for d in result.of_type(Drain)] == ["i-1"]
    assert result.of_type(Launch) == ()  # two kept nodes: at the target already
    # And when the risky node is simply gone, the pre-bought one is the fleet's second node.
    result = plan(observe(nodes=(HEALTHY, PREBOUGHT)), CFG, NOW)
    assert result.of_type(Drain) == () and result.of_type(Terminate) == () and result.of_type(Launch) == ()


def test_expiry_unfreezes_utilization_scaling() -> None:
    """Scaling judges only a fleet at its target: with the extra node it never could."""
    cfg = config(
        fleet={"min_nodes": 1, "max_nodes": 4},
        budget={"total_usd": 100.0, "max_usd_per_hour": 20.0},
        scaling={"cooldown_s": 0.0},
    )
    idle = dict(util=5.0)
    frozen = plan(observe(nodes=(at_risk_since(60, **idle), node("i-2", B, **idle), PREBOUGHT)), cfg, NOW)
    assert any("judging scale only once the fleet is at its target" in n for n in frozen.notes)
    after = observe(nodes=(at_risk_since(WINDOW + 1, **idle), node("i-2", B, **idle)))
    assert any("idle" in n for n in plan(after, cfg, NOW).notes)


def test_churn_cap_still_counts_expired_prebuys() -> None:
    """A fresh recommendation after an expired one is capped by the pre-buys of the last hour."""
    fresh = node("i-2", B, rebalance_at=NOW - 10)
    result = plan(observe(nodes=(at_risk_since(WINDOW + 1), fresh), rebalance_prebuys_last_hour=2), CFG, NOW)
    assert result.of_type(Launch) == ()
    assert any("reached max_recommendation_replacements_per_hour=2" in n for n in result.notes)


# ---------------------------------------------------------------- a wave, one purchase
def test_a_wave_of_notices_is_bought_back_in_one_launch_once_it_settles() -> None:
    cfg = config(fleet={"min_nodes": 1, "max_nodes": 4}, budget={"total_usd": 100.0, "max_usd_per_hour": 20.0})
    quiet = cfg.capacity.notice_coalesce_s

    def wave(first_ago: float, second_ago: float | None) -> Observation:
        nodes = [node("i-1", A, notice_at=NOW - first_ago, notice_deadline=NOW + 100), node("i-3", B), node("i-4", C)]
        nodes.append(
            node("i-2", A, notice_at=NOW - second_ago, notice_deadline=NOW + 100)
            if second_ago is not None
            else node("i-2", A)
        )
        return observe(nodes=tuple(nodes), target_nodes=4)

    # The first notice of the wave: drain it at once, but do not buy yet.
    early = plan(wave(0.2, None), cfg, NOW)
    assert [d.instance_id for d in early.of_type(Drain)] == ["i-1"]
    assert early.of_type(Launch) == ()
    assert early.replan_in_s == pytest.approx(quiet - 0.2)
    assert any("notices are still coming in" in n for n in early.notes)
    # The second arrives: both drained, still waiting for the wave to go quiet.
    mid = plan(wave(0.6, 0.1), cfg, NOW)
    assert {d.instance_id for d in mid.of_type(Drain)} == {"i-1", "i-2"} and mid.of_type(Launch) == ()
    # Quiet: one launch for both, away from the noticed pool.
    (launch,) = plan(wave(quiet + 0.5, quiet), cfg, NOW).of_type(Launch)
    assert launch.count == 2 and launch.purpose is LaunchPurpose.CAPACITY and A not in launch.pools
    # A wave that never goes quiet is bought back anyway, notice_coalesce_max_s after its start.
    late = cfg.capacity.notice_coalesce_max_s
    assert plan(wave(late + 0.1, 0.1), cfg, NOW).of_type(Launch)
