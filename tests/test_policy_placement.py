"""Placement (issue 3, pure): ranking, prior blend, capacity-error TTL, diversification,
on-demand fallback and back to spot, each with its reason, at a fixed ``now``."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetd.adapters.spot_advisor import SpotAdvisorError, load_spot_advisor
from fleetd.policy.model import Drain, Launch, LaunchPurpose, Market, NodePhase, RequestCheckpoint
from fleetd.policy.observation import Observation, PoolStats
from fleetd.policy.placement import (
    diversify,
    interruption_rate,
    prior_rate_for_bucket,
    priors_for_pools,
    rank_pools,
)
from fleetd.policy.planner import plan
from tests.harness.traces import trace_file
from tests.policy_fixtures import A, B, C, D, NOW, config, node, offer

ADVISOR_CSV = trace_file("aws_spot_advisor_gpu_snapshot_2025-06.csv")
CAP = config().capacity


def test_rank_by_price_per_gpu() -> None:
    ranked, skipped = rank_pools([offer(A, 0.60), offer(C, 2.00, od=5.0, gpus=4)], {}, CAP, NOW, Market.SPOT)
    assert [r.pool for r in ranked] == [C, A]  # $0.50 per GPU-hour beats $0.60
    assert ranked[0].reason == (
        "g6.xlarge@us-east-1a spot $2.000/h for 4 GPU ($0.500/GPU-h), 0.0000 interruptions/h "
        "(no history, no prior) -> $0.500 per useful GPU-h"
    )
    assert skipped == []


def test_interruption_history_penalises_a_cheaper_pool() -> None:
    # A is 10 % cheaper but interrupted us 20 times in 10 node-hours: 1.8/h after the prior.
    stats = {
        A: PoolStats(A, node_hours=10.0, notices=15, losses=5, prior_interruptions_per_hour=0.2),
        B: PoolStats(B, node_hours=10.0, prior_interruptions_per_hour=0.2),
    }
    cap = CAP.model_copy(update={"prior_weight_node_hours": 10.0, "interruption_cost_h": 0.25})
    ranked, _ = rank_pools([offer(A, 0.45), offer(B, 0.50)], stats, cap, NOW, Market.SPOT)
    assert [r.pool for r in ranked] == [B, A]
    assert ranked[1].interruptions_per_hour == pytest.approx((20 + 0.2 * 10) / (10 + 10))
    assert "20 interruptions in 10.0 node-h blended with prior 0.2000/h" in ranked[1].reason


def test_learned_rate_and_prior_blend() -> None:
    cap = CAP.model_copy(update={"prior_weight_node_hours": 50.0})
    # No history: the prior alone. Long history: mostly what the pool did to us.
    assert interruption_rate(PoolStats(A, prior_interruptions_per_hour=0.01), cap)[0] == pytest.approx(0.01)
    long = PoolStats(A, node_hours=950.0, notices=95, prior_interruptions_per_hour=0.01)
    assert interruption_rate(long, cap)[0] == pytest.approx((95 + 0.5) / 1000)
    assert interruption_rate(PoolStats(A, node_hours=4.0, losses=2), cap)[0] == pytest.approx(0.5)
    assert interruption_rate(None, cap) == (0.0, "no history, no prior")


def test_capacity_error_ttl_and_interrupting_now() -> None:
    stats = {
        A: PoolStats(A, capacity_error_until=NOW + 120),
        B: PoolStats(B, capacity_error_until=NOW),  # the TTL ends now: usable again
        C: PoolStats(C, last_notice_at=NOW - 60),
        D: PoolStats(D, last_notice_at=NOW - 2000),  # long ago: fine
    }
    offers = [offer(p, 0.4) for p in (A, B, C, D)]
    ranked, skipped = rank_pools(offers, stats, CAP, NOW, Market.SPOT)
    assert {r.pool for r in ranked} == {B, D}
    assert skipped == [
        "g5.xlarge@us-east-1a: capacity error, unavailable for another 120 s",
        "g6.xlarge@us-east-1a: interrupting now (notice 60 s ago)",
    ]


def test_spot_not_below_on_demand_or_above_max_price_is_skipped() -> None:
    cap = CAP.model_copy(update={"max_spot_price_per_hour": 0.5})
    ranked, skipped = rank_pools(
        [offer(A, 1.2, od=1.0), offer(B, 0.6), offer(C, None), offer(D, 0.3)], {}, cap, NOW, Market.SPOT
    )
    assert [r.pool for r in ranked] == [D]
    assert skipped == [
        "g5.xlarge@us-east-1a: spot $1.200/h is not below on-demand $1.000/h",
        "g5.xlarge@us-east-1b: spot $0.600/h above max_spot_price_per_hour $0.500/h",
        "g6.xlarge@us-east-1a: no spot price",
    ]


def test_diversification_spreads_over_types_and_zones_near_the_best() -> None:
    e = A.__class__("g5.2xlarge", "us-east-1a")
    offers = [offer(A, 0.40), offer(B, 0.41), offer(C, 0.42), offer(D, 0.43), offer(e, 0.90, od=2.0)]
    ranked, _ = rank_pools(offers, {}, CAP, NOW, Market.SPOT)
    cap = CAP.model_copy(update={"max_pools_per_launch": 3, "diversify_within": 1.5})
    chosen = [r.pool for r in diversify(ranked, cap)]
    # A first; D adds a new zone AND a new type; then B (new zone) over C (same as A and D's mix).
    assert chosen == [A, D, B]
    # The $0.90 pool is more than 1.5x the best score: never added for diversity's sake.
    wide = CAP.model_copy(update={"max_pools_per_launch": 10})
    assert e not in [r.pool for r in diversify(ranked, wide)]


def test_launch_carries_bid_budget_price_and_ranked_pools() -> None:
    obs = Observation(offers=(offer(A, 0.40), offer(D, 0.45, od=1.2)), target_nodes=2)
    (launch,) = plan(obs, config(fleet={"max_nodes": 2}), NOW).of_type(Launch)
    assert (launch.count, launch.market, launch.pools) == (2, Market.SPOT, (A, D))
    assert launch.max_price_per_hour == 1.2 and launch.budgeted_price_per_hour == 0.45
    assert launch.purpose is LaunchPurpose.CAPACITY
    # MaxTotalPrice for CreateFleet: the burn-rate room under max_usd_per_hour ($20/h by default).
    assert launch.max_total_price_per_hour == 20.0


# ------------------------------------------------------------------------- on-demand fallback
NO_SPOT = tuple(PoolStats(p, capacity_error_until=NOW + 300) for p in (A, B))
FALLBACK_CFG = config(fleet={"min_nodes": 1, "max_nodes": 1}, capacity={"spot_wait_s": 600.0})


@pytest.mark.parametrize(
    ("case", "since", "cfg", "launch", "reason"),
    [
        ("spot just became short", None, FALLBACK_CFG, False, "waiting for spot 0 of spot_wait_s 600 s"),
        ("still within spot_wait_s", NOW - 300, FALLBACK_CFG, False, "waiting for spot 300 of spot_wait_s 600 s"),
        (
            "waited long enough",
            NOW - 700,
            FALLBACK_CFG,
            True,
            "no spot for 700 s >= spot_wait_s 600: on-demand-fallback: buy 1 on-demand node(s)",
        ),
        (
            "on-demand not allowed",
            NOW - 700,
            config(fleet={"min_nodes": 1, "max_nodes": 1}, capacity={"allow_on_demand": False}),
            False,
            "on-demand fallback disabled (capacity.allow_on_demand = false): waiting for spot",
        ),
        (
            "on-demand not affordable",
            NOW - 700,
            config(fleet={"min_nodes": 1, "max_nodes": 1}, capacity={"spot_wait_s": 600.0},
                   budget={"max_usd_per_hour": 0.9}),
            False,
            "cannot buy 1 on-demand node(s) (on-demand-fallback): not even one fits the budget",
        ),
    ],
)
def test_on_demand_fallback(case, since, cfg, launch, reason) -> None:
    obs = Observation(
        offers=(offer(A, 0.4), offer(B, 0.4)), pool_stats=NO_SPOT, target_nodes=1,
        spot_unavailable_since=since,
    )
    result = plan(obs, cfg, NOW)
    assert result.spot_short
    launches = result.of_type(Launch)
    texts = [a.reason for a in launches] + list(result.notes)
    assert any(reason in t for t in texts), (case, texts)
    if launch:
        (a,) = launches
        assert a.market is Market.ON_DEMAND and a.purpose is LaunchPurpose.ON_DEMAND_FALLBACK
        assert a.max_price_per_hour is None and a.budgeted_price_per_hour == 1.0
    else:
        assert launches == (), case
    assert "capacity error, unavailable for another 300 s" in " ".join(result.notes)


# ------------------------------------------------------------------------------ back to spot
def _od(seen=NOW - 1):
    return node("i-od", B, market=Market.ON_DEMAND, price=1.0, seen=seen)


def test_back_to_spot_buys_spot_first_make_before_break() -> None:
    obs = Observation(nodes=(_od(),), offers=(offer(A, 0.4),), target_nodes=1, last_scaling_at=NOW)
    result = plan(obs, config(fleet={"max_nodes": 1}), NOW)
    (launch,) = result.of_type(Launch)
    assert launch.purpose is LaunchPurpose.RETURN_TO_SPOT and launch.market is Market.SPOT
    assert launch.count == 1 and launch.reason.startswith("return-to-spot: buy 1 spot node(s)")
    assert result.of_type(Drain) == ()  # the on-demand node keeps training meanwhile


def test_back_to_spot_waits_for_the_spot_node_to_join() -> None:
    booting = node("i-spot", phase=NodePhase.PENDING, seen=None, launched_at=NOW - 30)
    obs = Observation(nodes=(_od(), booting), offers=(offer(A, 0.4),), target_nodes=1, last_scaling_at=NOW)
    result = plan(obs, config(fleet={"max_nodes": 1}), NOW)
    assert result.actions == ()
    assert "back to spot: waiting for the new spot node to join training" in result.notes


def test_back_to_spot_asks_for_a_checkpoint_then_drains_after_it_is_durable() -> None:
    spot = node("i-spot", running_since=NOW - 40)
    before = Observation(
        nodes=(_od(), spot), offers=(offer(A, 0.4),), target_nodes=1, last_scaling_at=NOW,
        last_durable_checkpoint_step=900, last_durable_checkpoint_at=NOW - 100,
    )
    first = plan(before, config(fleet={"max_nodes": 1}), NOW)
    (ckpt,) = first.actions
    assert isinstance(ckpt, RequestCheckpoint)
    assert ckpt.reason == (
        "back to spot: draining on-demand i-od after the next durable checkpoint: none is "
        "durable since the spot node joined"
    )
    after = Observation(
        nodes=(_od(), spot), offers=(offer(A, 0.4),), target_nodes=1, last_scaling_at=NOW,
        last_durable_checkpoint_step=1000, last_durable_checkpoint_at=NOW - 5,
        last_checkpoint_request_at=NOW - 30,
    )
    (drain,) = plan(after, config(fleet={"max_nodes": 1}), NOW).actions
    assert isinstance(drain, Drain) and drain.instance_id == "i-od"
    assert drain.reason == (
        "back to spot: spot capacity is training again and checkpoint step 1000 is durable "
        "(5 s ago): draining on-demand i-od ($1.000/h)"
    )


# ----------------------------------------------------------------------- Spot Advisor prior
def test_spot_advisor_snapshot_gives_priors_per_pool() -> None:
    rows = load_spot_advisor(ADVISOR_CSV)
    assert len(rows) == 540
    pools = [A.__class__("g4dn.2xlarge", "af-south-1a"), A.__class__("g4dn.12xlarge", "af-south-1b"),
             A.__class__("nope.xlarge", "us-east-1a")]
    priors = priors_for_pools(rows, pools)
    assert priors == {pools[0]: prior_rate_for_bucket(4), pools[1]: prior_rate_for_bucket(0)}
    assert prior_rate_for_bucket(4) == pytest.approx(0.25 / 730)
    with pytest.raises(ValueError, match="bucket index 5"):
        prior_rate_for_bucket(5)


def test_spot_advisor_bad_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "advisor.csv"
    bad.write_text("region,instance_type,savings_vs_ondemand_pct,interruption_bucket_index\nx,y,z,1\n")
    with pytest.raises(SpotAdvisorError, match="line 2"):
        load_spot_advisor(bad)
    with pytest.raises(SpotAdvisorError, match="missing.csv"):
        load_spot_advisor(tmp_path / "missing.csv")


# ------------------------------------------------------------------ back to spot, in one batch
def _ods(n: int) -> tuple:
    return tuple(
        node(f"i-od{i}", B, market=Market.ON_DEMAND, price=1.0 + i / 100, seen=NOW - 1) for i in range(n)
    )


def test_back_to_spot_buys_every_replacement_in_one_launch() -> None:
    obs = Observation(nodes=_ods(3), offers=(offer(A, 0.4),), target_nodes=3, last_scaling_at=NOW)
    result = plan(obs, config(fleet={"max_nodes": 3}), NOW)
    (launch,) = result.of_type(Launch)
    assert launch.purpose is LaunchPurpose.RETURN_TO_SPOT and launch.count == 3
    assert launch.reason.startswith("return-to-spot: buy 3 spot node(s)")
    # Some replacements already bought: only the rest.
    spot = node("i-spot0", running_since=NOW - 40)
    obs = Observation(
        nodes=_ods(3) + (spot,), offers=(offer(A, 0.4),), target_nodes=3, last_scaling_at=NOW,
        last_durable_checkpoint_at=NOW - 100, last_checkpoint_request_at=NOW - 10,
    )
    (launch,) = plan(obs, config(fleet={"max_nodes": 3}), NOW).of_type(Launch)
    assert launch.purpose is LaunchPurpose.RETURN_TO_SPOT and launch.count == 2


def test_back_to_spot_drains_every_replaced_on_demand_node_in_one_pass() -> None:
    spots = tuple(node(f"i-spot{i}", running_since=NOW - 40) for i in range(3))
    obs = Observation(
        nodes=_ods(3) + spots, offers=(offer(A, 0.4),), target_nodes=3, last_scaling_at=NOW,
        last_durable_checkpoint_step=1000, last_durable_checkpoint_at=NOW - 5,
    )
    result = plan(obs, config(fleet={"max_nodes": 3}), NOW)
    drains = result.of_type(Drain)
    assert [d.instance_id for d in drains] == ["i-od2", "i-od1", "i-od0"]  # priciest first
    assert drains[0].reason == (
        "back to spot: spot capacity is training again and checkpoint step 1000 is durable (5 s ago): "
        "draining on-demand i-od2 ($1.020/h), one of 3 leaving together"
    )
    assert result.of_type(Launch) == ()  # the spot nodes now count: nothing more to buy


# ------------------------------------------------------------- on-demand fallback churn control
def _short_of_spot(notice_age: float, running: int, need: int) -> Observation:
    # The only spot pool A is held back by its own notice (interrupting_window_s 900 s): it is
    # offered again at notice + 900 s. ``running`` nodes train; ``need`` more are wanted.
    nodes = tuple(node(f"i-{i}") for i in range(running))
    return Observation(
        nodes=nodes,
        offers=(offer(A, 0.4), offer(B, None)),
        pool_stats=(PoolStats(A, node_hours=10.0, notices=1, last_notice_at=NOW - notice_age),),
        target_nodes=running + need,
        last_scaling_at=NOW,
        spot_unavailable_since=NOW - 700,
    )


CHURN_CFG = config(
    fleet={"max_nodes": 40},
    capacity={"spot_wait_s": 600.0, "interrupting_window_s": 900.0},
    rebalance={"checkpoint_stall_s": 5.0, "reform_s": 5.0},
)


def test_no_on_demand_fallback_when_spot_is_back_before_it_would_pay_for_its_reforms() -> None:
    # Back in 100 s: 2 nodes x 100 s = 200 node-s of training < 2 x 30 x 10 s = 600 node-s of stalls.
    result = plan(_short_of_spot(notice_age=800.0, running=28, need=2), CHURN_CFG, NOW)
    assert result.of_type(Launch) == () and result.spot_short
    assert (
        "no on-demand fallback: spot is offered again in 100 s (interrupting window), so 2 on-demand "
        "node(s) would train 200 node-s, less than their join and leave stall the fleet "
        "(2 x 30 nodes x 10 s = 600 node-s): waiting for spot"
    ) in result.notes


def test_on_demand_fallback_when_spot_stays_away_long_enough_or_its_return_is_unknown() -> None:
    # Back in 800 s: 1,600 node-s of training > 600 node-s of stalls.
    (launch,) = plan(_short_of_spot(notice_age=100.0, running=28, need=2), CHURN_CFG, NOW).of_type(Launch)
    assert launch.purpose is LaunchPurpose.ON_DEMAND_FALLBACK and launch.count == 2
    # A capacity error says nothing about when spot returns: fall back after spot_wait_s.
    obs = _short_of_spot(notice_age=800.0, running=28, need=2)
    errored = (PoolStats(A, node_hours=10.0, capacity_error_until=NOW + 1000, last_notice_at=NOW - 800),)
    obs = Observation(**{**{f: getattr(obs, f) for f in obs.__dataclass_fields__}, "pool_stats": errored})
    (launch,) = plan(obs, CHURN_CFG, NOW).of_type(Launch)
    assert launch.purpose is LaunchPurpose.ON_DEMAND_FALLBACK
