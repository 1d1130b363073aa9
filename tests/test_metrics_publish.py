"""fleetd/publish.py's PassPublisher with a stand-in reconciler: counters follow the state DB's
totals (once each), rebalances count once per instance, and a failed pass keeps the last budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from fleetd.config import FleetConfig, FleetdConfig
from fleetd.metrics import FleetMetrics
from fleetd.policy.model import BudgetLevel, BudgetStatus, Market, Node, Plan, PoolId
from fleetd.publish import PassPublisher
from fleetd.reconcile.ports import FleetSignals
from fleetd.snapshot import read_snapshot

A = PoolId("g5.xlarge", "us-east-1a")


@dataclass
class FakeState:
    rows: list = field(default_factory=list)
    stats: list = field(default_factory=list)

    async def instances(self):
        return self.rows

    async def pool_stats(self):
        return self.stats


class Observer:
    def __init__(self):
        self.rebalanced: set[str] = set()

    def observe(self, node: Node) -> Node:
        from dataclasses import replace

        return replace(node, rebalance_at=100.0) if node.instance_id in self.rebalanced else node


def row(iid: str, state: str = "running"):
    return SimpleNamespace(
        instance_id=iid,
        pool=A,
        market=Market.SPOT,
        price_per_hour=0.4,
        launched_at=10.0,
        ec2_state=state,
        notice_at=None,
        max_price_per_hour=None,
        drain_started_at=None,
    )


def stats(notices: int, capacity_errors: int):
    return SimpleNamespace(pool=A, notices=notices, capacity_errors=capacity_errors)


def values(metrics: FleetMetrics) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(metrics.render().decode())
        for s in fam.samples
    }


async def test_publisher_counts_once_and_keeps_the_last_budget(tmp_path):
    cfg = FleetdConfig(fleet=FleetConfig(name="p", state_dir=tmp_path))
    state = FakeState([row("i-1"), row("i-2")], [stats(1, 2)])
    observer = Observer()
    reconciler = SimpleNamespace(state=state, observer=observer, signals=SimpleNamespace(snapshot=FleetSignals))
    metrics = FleetMetrics("p")
    pub = PassPublisher(cfg, metrics)
    plan = Plan(target_nodes=2, budget=BudgetStatus(BudgetLevel.NORMAL, spent_usd=3.0, burn_usd_per_hour=0.8))

    await pub.publish(SimpleNamespace(now=1000.0, plan=plan, live_instances=("i-1", "i-2")), reconciler)
    observer.rebalanced.add("i-2")
    state.stats = [stats(3, 2)]  # two more notices, no new capacity error
    for now in (1001.0, 1002.0):  # the same facts seen twice are counted once
        await pub.publish(SimpleNamespace(now=now, plan=plan, live_instances=("i-1", "i-2")), reconciler)
    v = values(metrics)
    assert v[("fleetd_spot_notices_total", (("pool", str(A)),))] == 3
    assert v[("fleetd_capacity_errors_total", (("pool", str(A)),))] == 2
    assert v[("fleetd_rebalance_recommendations_total", (("pool", str(A)),))] == 1
    assert v[("fleetd_budget_spent_usd", ())] == 3.0

    # EC2 unreachable: no plan this pass. The snapshot still shows the last known budget.
    await pub.publish(SimpleNamespace(now=1003.0, plan=None, live_instances=()), reconciler)
    snap = read_snapshot(tmp_path)
    assert snap.written_at == 1003.0 and snap.budget.spent_usd == 3.0 and snap.target_nodes == 2
    assert [n.instance_id for n in snap.live_nodes] == ["i-1", "i-2"]


async def test_a_failing_publish_is_logged_and_the_component_keeps_going():
    import asyncio
    import contextlib

    from fleetd.publish import _publish_passes

    calls: list[float] = []

    class Broken:
        async def publish(self, report, reconciler):
            calls.append(report.now)
            raise OSError("No space left on device")

    ctx = SimpleNamespace(last_report=SimpleNamespace(now=1.0), reconciler=object())
    task = asyncio.create_task(_publish_passes(ctx, Broken()))
    await asyncio.sleep(0.5)
    ctx.last_report = SimpleNamespace(now=2.0)  # the next pass is tried again
    await asyncio.sleep(0.5)
    assert not task.done() and calls == [1.0, 2.0]  # each pass once, failures survived
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
