"""fleetd/metrics.py: the update functions the reconcile loop calls, and /metrics over HTTP."""

from __future__ import annotations

import math

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetd.metrics import FleetMetrics, MetricsServer
from fleetd.policy.model import BudgetLevel, BudgetStatus, Market, Node, NodePhase, PoolId
from fleetd.snapshot import build_snapshot

A = PoolId("g5.xlarge", "us-east-1a")
B = PoolId("g6.xlarge", "us-east-1b")


def samples(text: bytes | str) -> dict[tuple[str, tuple], float]:
    if isinstance(text, bytes):
        text = text.decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: FleetMetrics, name: str, **labels: str) -> float:
    return samples(metrics.render())[(name, tuple(sorted(labels.items())))]


def node(iid: str, pool: PoolId, market=Market.SPOT, phase=NodePhase.RUNNING, **kw) -> Node:
    return Node(iid, pool, market, 0.5, 1000.0, phase=phase, **kw)


def test_nodes_by_state_market_and_pool_and_emptied_groups_disappear():
    m = FleetMetrics("prod")
    m.set_nodes([node("i-1", A), node("i-2", A), node("i-3", B, Market.ON_DEMAND, NodePhase.DRAINING)])
    assert value(m, "fleetd_nodes", state="running", market="spot", pool=str(A)) == 2
    assert value(m, "fleetd_nodes", state="draining", market="on-demand", pool=str(B)) == 1
    m.set_nodes([node("i-1", A)])
    s = samples(m.render())
    assert (("fleetd_nodes", (("market", "on-demand"), ("pool", str(B)), ("state", "draining")))) not in s
    assert value(m, "fleetd_nodes", state="running", market="spot", pool=str(A)) == 1


def test_budget_rendezvous_and_counters():
    m = FleetMetrics("prod")
    m.set_budget(total_usd=100, spent_usd=42.5, burn_usd_per_hour=3.2, forecast_usd=80, level="warn")
    m.set_rendezvous(7, 3)
    m.count_notice(str(A))
    m.count_notice(str(A), 2)
    m.count_rebalance(str(B))
    m.count_capacity_error(str(B))
    assert value(m, "fleetd_budget_left_usd") == 57.5
    assert value(m, "fleetd_budget_spent_usd") == 42.5
    assert value(m, "fleetd_burn_rate_usd_per_hour") == 3.2
    assert value(m, "fleetd_budget_level", level="warn") == 1
    assert value(m, "fleetd_budget_level", level="normal") == 0
    assert value(m, "fleetd_rendezvous_round") == 7 and value(m, "fleetd_rendezvous_world_size") == 3
    assert value(m, "fleetd_spot_notices_total", pool=str(A)) == 3
    assert value(m, "fleetd_rebalance_recommendations_total", pool=str(B)) == 1
    assert value(m, "fleetd_capacity_errors_total", pool=str(B)) == 1
    assert value(m, "fleetd_info", fleet="prod") == 1


def test_checkpoint_age_is_computed_at_scrape_time():
    now = [1000.0]
    m = FleetMetrics("prod", clock=lambda: now[0])
    assert math.isnan(value(m, "fleetd_checkpoint_durable_age_seconds"))
    m.set_durable_checkpoint(step=300, durable_at=990.0)
    assert value(m, "fleetd_checkpoint_durable_age_seconds") == 10.0
    now[0] = 1060.0  # no update from the loop: the age still grows
    assert value(m, "fleetd_checkpoint_durable_age_seconds") == 70.0
    assert value(m, "fleetd_checkpoint_durable_step") == 300


def test_reconcile_duration_histogram_counts_failed_passes_too():
    m = FleetMetrics("prod")
    with m.time_reconcile():
        pass
    with pytest.raises(RuntimeError), m.time_reconcile():
        raise RuntimeError("adapter blew up")
    m.observe_reconcile(0.3)
    assert value(m, "fleetd_reconcile_duration_seconds_count") == 3
    assert value(m, "fleetd_reconcile_duration_seconds_bucket", le="0.25") == 2
    assert value(m, "fleetd_reconcile_duration_seconds_bucket", le="0.5") == 3


def test_other_registries_are_served_alongside_without_duplicate_names():
    from prometheus_client import CollectorRegistry, Counter, Gauge

    other = CollectorRegistry()
    Gauge("fleetd_nodes", "a clashing unlabelled gauge", registry=other).set(99)
    Counter("fleetd_actions", "actions", ["action"], registry=other).labels("Launch").inc()
    m = FleetMetrics("prod")
    m.set_nodes([node("i-1", A)])
    text = m.render(also=(other,)).decode()
    assert text.count("# TYPE fleetd_nodes gauge") == 1  # ours wins
    s = samples(text)
    assert ("fleetd_nodes", ()) not in s
    assert s[("fleetd_actions_total", (("action", "Launch"),))] == 1


def test_observe_snapshot_matches_the_snapshot():
    budget = BudgetStatus(level=BudgetLevel.NORMAL, spent_usd=10, burn_usd_per_hour=2, forecast_usd=30)
    snap = build_snapshot(
        now=2000.0,
        fleet="prod",
        reconcile_interval_s=10,
        target_nodes=3,
        nodes=[node("i-1", A), node("i-2", B), node("i-9", B, phase=NodePhase.TERMINATED, ec2_state="terminated")],
        budget=budget,
        budget_total_usd=50,
        budget_max_usd_per_hour=5,
        rendezvous=(4, 2),
        checkpoint=(120, 1990.0),
    )
    m = FleetMetrics("prod", clock=lambda: 2005.0)
    m.observe_snapshot(snap)
    node_samples = {k: v for k, v in samples(m.render()).items() if k[0] == "fleetd_nodes"}
    assert sum(node_samples.values()) == 2  # terminated nodes are history, not fleet
    assert value(m, "fleetd_budget_left_usd") == 40
    assert value(m, "fleetd_target_nodes") == 3
    assert value(m, "fleetd_rendezvous_round") == 4
    assert value(m, "fleetd_checkpoint_durable_age_seconds") == 15.0


async def test_metrics_endpoint_serves_the_registry():
    m = FleetMetrics("prod")
    m.set_nodes([node("i-1", A)])
    async with MetricsServer(m, "127.0.0.1", 0) as server:
        assert server.port != 0
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{server.port}/metrics") as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/plain")
                body = await resp.text()
            m.set_nodes([node("i-1", A), node("i-2", A)])  # the next scrape sees the update
            async with http.get(f"http://127.0.0.1:{server.port}/metrics") as resp:
                again = await resp.text()
    key = ("fleetd_nodes", (("market", "spot"), ("pool", str(A)), ("state", "running")))
    assert samples(body)[key] == 1 and samples(again)[key] == 2


def test_the_jobs_state_is_a_metric_and_moves_with_it():
    from fleetd.job_record import JobView
    from fleetd.policy.job_state import JobState

    m = FleetMetrics("prod", clock=lambda: 2005.0)
    for state, restarts in ((JobState.RUNNING, 0), (JobState.RECOVERING, 1), (JobState.FAILED, 3)):
        snap = build_snapshot(now=2000.0, fleet="prod", reconcile_interval_s=10, nodes=[])
        m.observe_snapshot(snap.model_copy(update={"job": JobView(state=state, restarts=restarts)}))
        states = {k[1]: v for k, v in samples(m.render()).items() if k[0] == "fleetd_job_state"}
        assert states == {(("state", str(state)),): 1.0}, states  # one state at a time
        assert value(m, "fleetd_job_restarts") == restarts
