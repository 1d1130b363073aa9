"""Placement (issue 3, pure): ranking, prior blend, capacity-error TTL, diversification,
on-demand fallback and back to spot, each with its reason, at a fixed ``now``."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetd.adapters.spot_advisor import SpotAdvisorError, load_spot_advisor
from fleetd.policy.model import Drain, Launch, LaunchPurpose, Market, NodePhase, PoolId, PoolOffer, RequestCheckpoint
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
from tests.policy_fixtures import NOW, A, B, C, D, config, node, offer

ADVISOR_CSV = trace_file("aws_spot_advisor_gpu_snapshot_2025-06.csv")
CAP = config().capacity


def test_rank_by_price_per_gpu() -> None:
    ranked, skipped = rank_pools([offer(A, 0.60), offer(C, 2.00, od=5.0, gpus=4)], {}, CAP, NOW, Market.SPOT)
    assert [r.pool for r in ranked] == [C, A]  # $0.50 per GPU-hour beats $0.60
    assert ranked[0].reason == (
        "g6.xlarge@us-east-1a spot $2.000/h for 4 GPU x 1 A10G-equivalent ($0.500/useful GPU-h), "
        "0.0000 interruptions/h (no history, no prior) x 0.25 h lost each -> $0.500 per useful GPU-h"
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
        "g6.xlarge@us-east-1a: reclaim wave under way (notice 60 s ago; a node bought now would "
        "likely be reclaimed with it), usable as a last resort in 60 s",
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
    # Zones mixed freely (cross_az_penalty 0): the default keeps one job in one zone (below).
    free = CAP.model_copy(update={"cross_az_penalty": 0.0})
    ranked, _ = rank_pools(offers, {}, free, NOW, Market.SPOT)
    cap = free.model_copy(update={"max_pools_per_launch": 3, "diversify_within": 1.5})
    chosen = [r.pool for r in diversify(ranked, cap)]
    # A first; D adds a new zone AND a new type; then B (new zone) over C (same as A and D's mix).
    assert chosen == [A, D, B]
    # The $0.90 pool is more than 1.5x the best score: never added for diversity's sake.
    wide = free.model_copy(update={"max_pools_per_launch": 10})
    assert e not in [r.pool for r in diversify(ranked, wide)]


def test_launch_carries_bid_budget_price_and_ranked_pools() -> None:
    obs = Observation(offers=(offer(A, 0.40), offer(D, 0.45, od=1.2)), target_nodes=2)
    cfg = config(fleet={"max_nodes": 2}, capacity={"cross_az_penalty": 0.0})
    (launch,) = plan(obs, cfg, NOW).of_type(Launch)
    assert (launch.count, launch.market, launch.pools) == (2, Market.SPOT, (A, D))
    assert launch.max_price_per_hour == 1.2 and launch.budgeted_price_per_hour == 0.45
    assert launch.purpose is LaunchPurpose.CAPACITY
    # MaxTotalPrice for CreateFleet: the burn-rate room under max_usd_per_hour ($20/h by default).
    assert launch.max_total_price_per_hour == 20.0


# ------------------------------------------------------------------------- on-demand fallback
# Fresh capacity errors (10 s old at the default 600 s TTL): too young for a probe of spot.
NO_SPOT = tuple(PoolStats(p, capacity_error_until=NOW + 590) for p in (A, B))
FALLBACK_CFG = config(fleet={"min_nodes": 1, "max_nodes": 1}, capacity={"spot_wait_s": 600.0, "on_demand": "hold_size"})


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
            config(fleet={"min_nodes": 1, "max_nodes": 1}, capacity={"on_demand": "never"}),
            False,
            'no on-demand (capacity.on_demand = "never"): waiting for spot',
        ),
        (
            "the default: on-demand only for a deadline, and there is none",
            NOW - 700,
            config(fleet={"min_nodes": 1, "max_nodes": 1}),
            False,
            'no on-demand: no job.deadline asks for it (capacity.on_demand = "deadline"): waiting for spot',
        ),
        (
            "on-demand not affordable",
            NOW - 700,
            config(
                fleet={"min_nodes": 1, "max_nodes": 1},
                capacity={"spot_wait_s": 600.0, "on_demand": "hold_size"},
                budget={"max_usd_per_hour": 0.9},
            ),
            False,
            "cannot buy 1 on-demand node(s) (on-demand-fallback): not even one fits the budget",
        ),
    ],
)
def test_on_demand_fallback(case, since, cfg, launch, reason) -> None:
    obs = Observation(
        offers=(offer(A, 0.4), offer(B, 0.4)),
        pool_stats=NO_SPOT,
        target_nodes=1,
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
    assert "capacity error, unavailable for another 590 s" in " ".join(result.notes)


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
        nodes=(_od(), spot),
        offers=(offer(A, 0.4),),
        target_nodes=1,
        last_scaling_at=NOW,
        last_durable_checkpoint_step=900,
        last_durable_checkpoint_at=NOW - 100,
    )
    first = plan(before, config(fleet={"max_nodes": 1}), NOW)
    (ckpt,) = first.actions
    assert isinstance(ckpt, RequestCheckpoint)
    assert ckpt.reason == (
        "back to spot: draining on-demand i-od after the next durable checkpoint: none is "
        "durable since the spot node joined"
    )
    after = Observation(
        nodes=(_od(), spot),
        offers=(offer(A, 0.4),),
        target_nodes=1,
        last_scaling_at=NOW,
        last_durable_checkpoint_step=1000,
        last_durable_checkpoint_at=NOW - 5,
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
    pools = [
        A.__class__("g4dn.2xlarge", "af-south-1a"),
        A.__class__("g4dn.12xlarge", "af-south-1b"),
        A.__class__("nope.xlarge", "us-east-1a"),
    ]
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
    return tuple(node(f"i-od{i}", B, market=Market.ON_DEMAND, price=1.0 + i / 100, seen=NOW - 1) for i in range(n))


def test_back_to_spot_buys_every_replacement_in_one_launch() -> None:
    obs = Observation(nodes=_ods(3), offers=(offer(A, 0.4),), target_nodes=3, last_scaling_at=NOW)
    result = plan(obs, config(fleet={"max_nodes": 3}), NOW)
    (launch,) = result.of_type(Launch)
    assert launch.purpose is LaunchPurpose.RETURN_TO_SPOT and launch.count == 3
    assert launch.reason.startswith("return-to-spot: buy 3 spot node(s)")
    # Some replacements already bought: only the rest.
    spot = node("i-spot0", running_since=NOW - 40)
    obs = Observation(
        nodes=_ods(3) + (spot,),
        offers=(offer(A, 0.4),),
        target_nodes=3,
        last_scaling_at=NOW,
        last_durable_checkpoint_at=NOW - 100,
        last_checkpoint_request_at=NOW - 10,
    )
    (launch,) = plan(obs, config(fleet={"max_nodes": 3}), NOW).of_type(Launch)
    assert launch.purpose is LaunchPurpose.RETURN_TO_SPOT and launch.count == 2


def test_back_to_spot_drains_every_replaced_on_demand_node_in_one_pass() -> None:
    spots = tuple(node(f"i-spot{i}", running_since=NOW - 40) for i in range(3))
    obs = Observation(
        nodes=_ods(3) + spots,
        offers=(offer(A, 0.4),),
        target_nodes=3,
        last_scaling_at=NOW,
        last_durable_checkpoint_step=1000,
        last_durable_checkpoint_at=NOW - 5,
    )
    result = plan(obs, config(fleet={"max_nodes": 3}), NOW)
    drains = result.of_type(Drain)
    assert [d.instance_id for d in drains] == ["i-od2", "i-od1", "i-od0"]  # priciest first
    assert drains[0].reason == (
        "back to spot: spot capacity is training again and checkpoint step 1000 is durable (5 s ago): "
        "draining on-demand i-od2 ($1.020/h), one of 3 leaving together"
    )
    assert result.of_type(Launch) == ()  # the spot nodes now count: nothing more to buy


# ------------------------------------------------ cost per useful GPU-hour (issue 15, part 2)
def _hw(pool, spot, od, gpus, rel, model):
    return PoolOffer(
        pool=pool, gpus=gpus, spot_price=spot, on_demand_price=od, gpu_model=model, relative_throughput=rel
    )


def test_an_h100_pool_beats_a_t4_pool_per_useful_gpu_hour_at_realistic_prices() -> None:
    # us-east-1 list prices: p5.48xlarge 8 x H100 $98.32/h, g4dn.xlarge 1 x T4 $0.526/h; spot at
    # Spot Advisor-like savings. Per GPU the T4 is 30x cheaper; per unit of training it is not.
    # An H100 trains ~7.5x as fast as an A10G, a T4 ~0.3x (assumed here; the catalog has sources).
    h100 = _hw(PoolId("p5.48xlarge", "us-east-1a"), 35.0, 98.32, 8, 7.5, "H100")
    t4 = _hw(PoolId("g4dn.xlarge", "us-east-1a"), 0.189, 0.526, 1, 0.3, "T4")
    ranked, skipped = rank_pools([t4, h100], {}, CAP, NOW, Market.SPOT)
    assert skipped == []
    assert [r.pool for r in ranked] == [h100.pool, t4.pool]  # per GPU it was T4 by 23x
    assert ranked[0].score == pytest.approx(35.0 / (8 * 7.5))  # $0.583 per A10G-equivalent hour
    assert ranked[1].score == pytest.approx(0.189 / 0.3)  # $0.630
    assert "8 GPU x 7.5 A10G-equivalent" in ranked[0].reason


def test_t4_wins_when_the_h100_throughput_edge_is_smaller_than_its_price_edge() -> None:
    h100 = _hw(PoolId("p5.48xlarge", "us-east-1a"), 35.0, 98.32, 8, 3.0, "H100")
    t4 = _hw(PoolId("g4dn.xlarge", "us-east-1a"), 0.189, 0.526, 1, 0.3, "T4")
    ranked, _ = rank_pools([h100, t4], {}, CAP, NOW, Market.SPOT)
    assert [r.pool for r in ranked] == [t4.pool, h100.pool]


def test_a_pool_with_no_price_or_throughput_is_excluded_with_a_reason() -> None:
    no_od = PoolOffer(pool=A, gpus=1, spot_price=0.3, on_demand_price=0.0)
    no_spot = offer(B, None)
    unknown = PoolOffer(pool=C, gpus=1, spot_price=0.3, on_demand_price=1.0, relative_throughput=0.0)
    ranked, skipped = rank_pools([no_od, no_spot, unknown, offer(D, 0.4)], {}, CAP, NOW, Market.SPOT)
    assert [r.pool for r in ranked] == [D]
    assert skipped == [
        "g5.xlarge@us-east-1a: no on-demand price (spot bids and savings are judged against it)",
        "g5.xlarge@us-east-1b: no spot price",
        "g6.xlarge@us-east-1a: no training throughput known for its GPU model",
    ]
    od_ranked, od_skipped = rank_pools([no_od, offer(D, 0.4)], {}, CAP, NOW, Market.ON_DEMAND)
    assert [r.pool for r in od_ranked] == [D] and len(od_skipped) == 1


def test_reform_cost_of_interruptions_grows_with_the_fleet() -> None:
    stats = {A: PoolStats(A, node_hours=10.0, notices=5)}  # 0.5 interruptions per node-hour
    small, _ = rank_pools([offer(A, 0.4)], stats, CAP, NOW, Market.SPOT, reform_cost_h=0.0)
    big, _ = rank_pools([offer(A, 0.4)], stats, CAP, NOW, Market.SPOT, reform_cost_h=1.0)
    assert small[0].score == pytest.approx(0.4 * (1 + 0.5 * 0.25))
    assert big[0].score == pytest.approx(0.4 * (1 + 0.5 * 1.25))


def test_a_pool_outside_the_jobs_zone_pays_the_cross_az_penalty() -> None:
    # D (us-east-1c) is 20 % cheaper, but the job trains in us-east-1a.
    ranked, _ = rank_pools([offer(A, 0.50), offer(D, 0.40)], {}, CAP, NOW, Market.SPOT, fleet_zone="us-east-1a")
    assert [r.pool for r in ranked] == [A, D]
    assert ranked[1].score == pytest.approx(0.40 * 2.0) and "cross_az_penalty" in ranked[1].reason
    # More than twice as cheap: worth crossing.
    ranked, _ = rank_pools([offer(A, 0.90), offer(D, 0.40)], {}, CAP, NOW, Market.SPOT, fleet_zone="us-east-1a")
    assert [r.pool for r in ranked] == [D, A]
    # No job yet: the best pool's zone is the reference.
    ranked, _ = rank_pools([offer(A, 0.50), offer(D, 0.40)], {}, CAP, NOW, Market.SPOT)
    assert [r.pool for r in ranked] == [D, A]


def test_an_interrupting_pool_is_a_last_resort_not_dropped() -> None:
    stats = {A: PoolStats(A, last_notice_at=NOW - 300)}  # past its reclaim wave, in the window
    ranked, skipped = rank_pools([offer(A, 0.3), offer(B, 0.4)], stats, CAP, NOW, Market.SPOT)
    assert [r.pool for r in ranked] == [B] and skipped == ["g5.xlarge@us-east-1a: interrupting now (notice 300 s ago)"]
    ranked, skipped = rank_pools([offer(A, 0.3)], stats, CAP, NOW, Market.SPOT)
    assert [r.pool for r in ranked] == [A] and ranked[0].reason.startswith("last resort, interrupting now")
