"""The reconcile loop's own rules, against the in-memory EC2 (no network), on a fixed clock:
errors become observations, permanent errors are held and logged once, throttling backs off,
an unsettled launch is resumed with the same token, dry runs change nothing, the ledger is fed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from fleetd.adapters.aws_errors import PermanentAwsError, Throttled, TransientAwsError
from fleetd.adapters.ec2_fake import FakeEc2
from fleetd.adapters.pricing import FilePriceBook
from fleetd.config import FleetConfig, FleetdConfig
from fleetd.policy.memory import with_memory
from fleetd.policy.model import Launch, Market, Node, Plan, PoolId, Terminate
from fleetd.policy.observation import Observation
from fleetd.reconcile import state as st
from fleetd.reconcile.build import ledger_beside
from fleetd.reconcile.ledger_store import LedgerStore
from fleetd.reconcile.loop import MAX_BACKOFF_S, Reconciler
from fleetd.reconcile.state import StateStore
from tests.reconcile_support import FakeClock

T0 = 1_800_000_000.0
A = PoolId("g4dn.xlarge", "us-east-1a")
B = PoolId("g5.xlarge", "us-east-1b")
BOOK = FilePriceBook.demo()


class Scripted:
    """A planner that returns what the test says, and keeps what it was shown."""

    def __init__(self, decide: Callable[[Observation], tuple]):
        self.decide = decide
        self.seen: list[Observation] = []

    def __call__(self, obs: Observation, cfg: FleetdConfig, now: float) -> Plan:
        self.seen.append(obs)
        return with_memory(Plan(actions=tuple(self.decide(obs)), target_nodes=3), obs, now)


def launch(count: int = 2, pools=(A, B)) -> Launch:
    return Launch(
        reason="test: need nodes",
        count=count,
        market=Market.SPOT,
        pools=pools,
        max_price_per_hour=0.5,
        budgeted_price_per_hour=0.4,
    )


async def make(
    tmp_path: Path,
    planner,
    *,
    dry_run: bool = False,
    ledger=None,
    observer=None,
    ec2: FakeEc2 | None = None,
    clock: FakeClock | None = None,
) -> Reconciler:
    clock = clock or FakeClock(T0)
    cfg = FleetdConfig(fleet=FleetConfig(name="t", state_dir=tmp_path, reconcile_interval_s=10.0))
    state = await (StateStore.open_snapshot if dry_run else StateStore.open)(tmp_path)
    if ledger is None:
        ledger = await ledger_beside(state)  # the daemon's layout: the ledger in the state's file
    return Reconciler(
        cfg,
        ec2=ec2 or FakeEc2(clock),
        prices=BOOK,
        state=state,
        pools=(A, B),
        hardware={t: BOOK.hardware(t) for t in ("g4dn.xlarge", "g5.xlarge")},
        planner=planner,
        clock=clock,
        dry_run=dry_run,
        ledger=ledger,
        observer=observer,
    )


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_observation_carries_offers_nodes_and_memory(tmp_path: Path) -> None:
    planner = Scripted(lambda obs: [launch()] if not obs.nodes else [])
    r = await make(tmp_path, planner)
    await r.run_pass()
    await r.run_pass()
    first, second = planner.seen
    assert {o.pool for o in first.offers} == {A, B}
    offer = {o.pool: o for o in first.offers}[A]
    assert (offer.gpus, offer.gpu_model, offer.spot_price, offer.on_demand_price) == (1, "T4", 0.2206, 0.526)
    assert [n.pool for n in second.nodes] == [A, A] and all(n.max_price_per_hour == 0.5 for n in second.nodes)
    assert second.target_nodes == 3 and second.last_scaling_at == T0
    assert second.spent_usd > 0  # the ledger's bills: 60 s minimum each from launch
    await r.state.close()


async def test_permanent_error_is_held_logged_once_and_counted(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    ec2 = FakeEc2(clock)
    denied = PermanentAwsError("CreateFleet", "UnauthorizedOperation", "not authorized")
    ec2.fail_next["CreateFleet"] = [denied]
    r = await make(tmp_path, Scripted(lambda obs: [launch()]), ec2=ec2, clock=clock)
    before = metric("fleetd_aws_errors_total", operation="CreateFleet", kind="permanent", code="UnauthorizedOperation")
    with capture_logs() as logs:
        reports = []
        for _ in range(3):
            reports.append(await r.run_pass())
            clock.advance(10)
    assert [rep.outcomes[0].status for rep in reports] == ["held", "held", "held"]
    assert ec2.count("CreateFleet") == 1  # not retried every pass
    assert [e["event"] for e in logs].count("aws_permanent_error") == 1
    assert (
        metric("fleetd_aws_errors_total", operation="CreateFleet", kind="permanent", code="UnauthorizedOperation")
        == before + 1
    )
    assert [row.status for row in await r.state.launches()] == [st.FAILED]
    await r.state.close()


async def test_throttling_backs_off_exponentially_with_a_cap(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    ec2 = FakeEc2(clock)
    ec2.fail_next["DescribeInstances"] = [Throttled("DescribeInstances", "RequestLimitExceeded", "slow down")] * 12
    r = await make(tmp_path, Scripted(lambda obs: []), ec2=ec2, clock=clock)
    delays = []
    for _ in range(12):
        report = await r.run_pass()
        assert report.throttled
        delays.append(r.next_delay(report))
    assert delays[0] >= 10.0 and delays[3] > delays[0] * 2
    assert max(delays) <= MAX_BACKOFF_S
    ok = await r.run_pass()
    assert ok.error is None and r.next_delay(ok) == 10.0
    # A planner waiting out a wave of notices asks to plan again sooner than the interval.
    soon = dataclasses.replace(ok, plan=dataclasses.replace(ok.plan, replan_in_s=0.7))
    assert r.next_delay(soon) == 0.7
    await r.state.close()


async def test_transient_error_leaves_intent_open_and_the_retry_reuses_the_token(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    ec2 = FakeEc2(clock)
    ec2.fail_next["CreateFleet"] = [TransientAwsError("CreateFleet", "ReadTimeoutError", "read timed out")]
    r = await make(tmp_path, Scripted(lambda obs: [launch()] if not obs.nodes else []), ec2=ec2, clock=clock)
    first = await r.run_pass()
    assert isinstance(first.error, TransientAwsError)
    assert [row.status for row in await r.state.launches()] == [st.OPEN]
    await r.run_pass()
    tokens = [spec.token for op, spec in ec2.calls if op == "CreateFleet"]
    assert len(tokens) == 2 and tokens[0] == tokens[1]  # same planned launch, same ClientToken
    assert [row.status for row in await r.state.launches()] == [st.LAUNCHED]
    assert len(ec2.live()) == 2
    await r.state.close()


async def test_capacity_failures_mark_pools_for_the_ttl(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    ec2 = FakeEc2(clock, no_capacity={A: "InsufficientInstanceCapacity"})
    planner = Scripted(lambda obs: [launch(pools=(A, B))] if not obs.nodes else [])
    r = await make(tmp_path, planner, ec2=ec2, clock=clock)
    report = await r.run_pass()
    assert report.outcomes[0].status == "done" and {i.pool for i in ec2.live()} == {B}
    await r.run_pass()
    stats = planner.seen[1].stats_by_pool()
    assert stats[A].capacity_error_until == T0 + r.cfg.capacity.capacity_error_ttl_s
    assert stats[B].capacity_error_until is None
    await r.state.close()


async def test_every_pool_failing_sets_spot_unavailable_since(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    ec2 = FakeEc2(clock, no_capacity={A: "InsufficientInstanceCapacity", B: "SpotMaxPriceTooLow"})
    planner = Scripted(lambda obs: [launch()] if not obs.nodes else [])
    r = await make(tmp_path, planner, ec2=ec2, clock=clock)
    assert (await r.run_pass()).outcomes[0].status == "failed"
    clock.advance(10)
    await r.run_pass()
    assert planner.seen[1].spot_unavailable_since == T0
    ec2.no_capacity.clear()
    clock.advance(200)  # past the TTL
    await r.run_pass()
    assert await r.state.get_meta("spot_unavailable_since") is None
    await r.state.close()


async def test_terminate_only_reaches_fleet_instances(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    ec2 = FakeEc2(clock)
    r = await make(tmp_path, Scripted(lambda obs: [launch(1)] if not obs.nodes else []), ec2=ec2, clock=clock)
    await r.run_pass()
    mine = ec2.live()[0].instance_id
    ec2.foreign.add("i-someone-else")
    r.planner = Scripted(
        lambda obs: [
            Terminate(reason="scale down", instance_id=mine),
            Terminate(reason="bogus", instance_id="i-someone-else"),
        ]
    )
    report = await r.run_pass()
    assert [(o.action.instance_id, o.status) for o in report.outcomes] == [(mine, "done"), ("i-someone-else", "failed")]
    r.planner = Scripted(lambda obs: [])
    await r.run_pass()
    (row,) = await r.state.instances(open_only=False)
    assert row.end_reason == "terminated by fleetd"
    assert sum(s.losses for s in await r.state.pool_stats()) == 0
    await r.state.close()


async def test_dry_run_plans_but_touches_nothing(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    ec2 = FakeEc2(clock)
    r = await make(tmp_path, Scripted(lambda obs: [launch()]), ec2=ec2, clock=clock, dry_run=True)
    report = await r.run_pass()
    assert [o.status for o in report.outcomes] == ["dry-run"]
    assert ec2.count("CreateFleet") == 0 and not ec2.instances
    assert not (tmp_path / "fleetd.db").exists()  # the live state directory was never written
    await r.state.close()


@dataclasses.dataclass
class NoticeObserver:
    notice_at: dict[str, float] = dataclasses.field(default_factory=dict)
    tracked: set[str] = dataclasses.field(default_factory=set)

    def track(self, instance_id: str) -> None:
        self.tracked.add(instance_id)

    def observe(self, node: Node) -> Node:
        at = self.notice_at.get(node.instance_id)
        return dataclasses.replace(node, notice_at=at, last_seen_at=T0) if at else node


async def test_notices_and_losses_feed_pool_stats_and_the_ledger(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    ec2 = FakeEc2(clock)
    observer = NoticeObserver()
    ledger = await LedgerStore.open(tmp_path / "fleetd.db")
    r = await make(
        tmp_path,
        Scripted(lambda obs: [launch()] if not obs.nodes else []),
        ec2=ec2,
        clock=clock,
        ledger=ledger,
        observer=observer,
    )
    await r.run_pass()
    a, b = (i.instance_id for i in ec2.live())
    assert observer.tracked == set()  # tracked once EC2 shows them
    clock.advance(1800)
    await r.run_pass()
    assert observer.tracked == {a, b}
    observer.notice_at[a] = clock()
    await r.run_pass()
    await r.run_pass()  # the same notice seen again is not counted twice
    ec2.interrupt(a)
    ec2.interrupt(b)  # b goes without a notice: a loss
    clock.advance(60)
    r.planner = Scripted(lambda obs: [])
    await r.run_pass()
    (stats,) = [s for s in await r.state.pool_stats() if s.pool == A]
    assert (stats.notices, stats.losses) == (1, 1)
    assert stats.node_hours == pytest.approx(2 * 1860 / 3600)
    kinds = sorted(type(e).__name__ for e in await ledger.events())
    assert kinds.count("InstanceStarted") == 2 and kinds.count("InstanceStopped") == 2
    assert kinds.count("Interruption") == 2
    spent = await ledger.spent_usd(clock())
    assert spent == pytest.approx(2 * 0.2206 * 1860 / 3600, rel=1e-6)
    # A restarted loop re-sends everything it knows: the ledger stores each event once.
    count = len(await ledger.events())
    await r.state.close()
    r2 = await make(tmp_path, Scripted(lambda obs: []), ec2=ec2, clock=clock, ledger=ledger)
    await r2.run_pass()
    assert len([e for e in await ledger.events() if type(e).__name__ != "PriceChanged"]) == len(
        [e for e in (await ledger.events())[:count] if type(e).__name__ != "PriceChanged"]
    )
    assert await ledger.spent_usd(clock()) == pytest.approx(spent)
    await r2.state.close()
    await ledger.close()
