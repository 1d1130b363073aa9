"""What the reconcile loop remembers about capacity shortages, against the in-memory EC2:

- ``spot_unavailable_since`` ends with the shortage however it ends (not only by a spot launch
  succeeding), so a later shortage waits ``capacity.spot_wait_s`` again before on-demand;
- capacity errors are remembered per market: an on-demand shortage does not block spot in that
  pool, a spot shortage does not block on-demand; both survive in the state DB (and an existing
  DB from before the on-demand column gets it on open).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from structlog.testing import capture_logs

from fleetd.adapters.ec2_fake import FakeEc2
from fleetd.adapters.pricing import FilePriceBook
from fleetd.config import FleetConfig, FleetdConfig
from fleetd.policy.memory import with_memory
from fleetd.policy.model import Launch, Market, Plan, PoolId
from fleetd.policy.observation import Observation
from fleetd.policy.placement import rank_pools
from fleetd.reconcile.build import ledger_beside
from fleetd.reconcile.loop import Reconciler
from fleetd.reconcile.state import StateStore
from tests.reconcile_support import FakeClock

T0 = 1_800_000_000.0
A = PoolId("g4dn.xlarge", "us-east-1a")
B = PoolId("g5.xlarge", "us-east-1b")
BOOK = FilePriceBook.demo()


class ScriptedPlans:
    """A planner that returns the plan the test scripts for each pass (with the memory it leaves,
    as every planner returns it), and keeps what it saw."""

    def __init__(self, decide: Callable[[int, Observation], Plan]):
        self.decide = decide
        self.seen: list[Observation] = []

    def __call__(self, obs: Observation, cfg: FleetdConfig, now: float) -> Plan:
        self.seen.append(obs)
        return with_memory(self.decide(len(self.seen) - 1, obs), obs, now)


def launch(market: Market, pools: tuple[PoolId, ...]) -> Launch:
    return Launch(
        reason="test: need a node",
        count=1,
        market=market,
        pools=pools,
        max_price_per_hour=0.5 if market is Market.SPOT else None,
        budgeted_price_per_hour=0.4,
    )


async def make(tmp_path: Path, planner, ec2: FakeEc2, clock: FakeClock) -> Reconciler:
    cfg = FleetdConfig(fleet=FleetConfig(name="t", state_dir=tmp_path, reconcile_interval_s=10.0))
    state = await StateStore.open(tmp_path)
    return Reconciler(
        cfg,
        ec2=ec2,
        prices=BOOK,
        state=state,
        pools=(A, B),
        hardware={t: BOOK.hardware(t) for t in ("g4dn.xlarge", "g5.xlarge")},
        planner=planner,
        clock=clock,
        ledger=await ledger_beside(state),
    )


# -- 1. spot_unavailable_since ends with the shortage ---------------------------------------------


async def test_a_shortage_that_ends_without_a_spot_launch_is_forgotten(tmp_path: Path) -> None:
    # Pass 0: spot is short (waiting). Pass 1: the need went away, no spot launch. Pass 2: a new
    # shortage. It must start its own spot_wait_s, not inherit the first one's start.
    short = Plan(target_nodes=1, spot_short=True)
    plans = [short, Plan(target_nodes=0), short]
    planner = ScriptedPlans(lambda i, obs: plans[i])
    clock = FakeClock(T0)
    r = await make(tmp_path, planner, FakeEc2(clock), clock)

    await r.run_pass()
    assert await r.state.get_meta("spot_unavailable_since") == T0
    clock.advance(60)
    with capture_logs() as logs:
        await r.run_pass()
    assert planner.seen[1].spot_unavailable_since == T0
    assert await r.state.get_meta("spot_unavailable_since") is None  # persisted, not just in memory
    assert [e["unavailable_for_s"] for e in logs if e["event"] == "spot_available_again"] == [60.0]
    clock.advance(3600)
    await r.run_pass()
    assert planner.seen[2].spot_unavailable_since is None  # the planner waits spot_wait_s afresh
    assert await r.state.get_meta("spot_unavailable_since") == T0 + 3660
    await r.state.close()


async def test_a_spot_retry_that_fails_keeps_the_shortage_start(tmp_path: Path) -> None:
    # A pool whose capacity-error TTL ran out is retried (spot_short False, spot launch planned):
    # the launch decides. A failure must not restart the on-demand fallback's wait; a success
    # ends the shortage.
    clock = FakeClock(T0)
    ec2 = FakeEc2(clock, no_capacity={A: "InsufficientInstanceCapacity"})
    plans = [
        Plan(target_nodes=1, spot_short=True),
        Plan(actions=(launch(Market.SPOT, (A,)),), target_nodes=1),
        Plan(actions=(launch(Market.SPOT, (A,)),), target_nodes=1),
    ]
    r = await make(tmp_path, ScriptedPlans(lambda i, obs: plans[i]), ec2, clock)

    await r.run_pass()
    clock.advance(300)
    report = await r.run_pass()
    assert [o.status for o in report.outcomes] == ["failed"]
    assert await r.state.get_meta("spot_unavailable_since") == T0
    ec2.no_capacity.clear()
    clock.advance(300)
    report = await r.run_pass()
    assert [o.status for o in report.outcomes] == ["done"] and len(ec2.live()) == 1
    assert await r.state.get_meta("spot_unavailable_since") is None
    await r.state.close()


# -- 2. capacity errors per market ----------------------------------------------------------------


async def test_an_on_demand_capacity_error_does_not_block_spot_and_the_reverse(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    ec2 = FakeEc2(clock, no_capacity={A: "InsufficientInstanceCapacity"})
    plans = [
        Plan(actions=(launch(Market.ON_DEMAND, (A,)),)),
        Plan(),
        Plan(actions=(launch(Market.SPOT, (A,)),)),
        Plan(actions=(launch(Market.SPOT, (B,)),)),
        Plan(),
    ]
    planner = ScriptedPlans(lambda i, obs: plans[i])
    r = await make(tmp_path, planner, ec2, clock)
    ttl = r.cfg.capacity.capacity_error_ttl_s

    with capture_logs() as logs:
        report = await r.run_pass()
    assert [o.status for o in report.outcomes] == ["failed"]
    assert [(e["pool"], e["market"]) for e in logs if e["event"] == "pool_unavailable"] == [(str(A), "on-demand")]
    rows = {s.pool: s for s in await r.state.pool_stats()}
    assert (rows[A].on_demand_capacity_error_until, rows[A].capacity_error_until) == (T0 + ttl, None)
    assert await r.state.get_meta("spot_unavailable_since") is None  # an on-demand failure says nothing of spot

    clock.advance(10)
    await r.run_pass()
    obs = planner.seen[1]
    stats = obs.stats_by_pool()
    assert (stats[A].on_demand_capacity_error_until, stats[A].capacity_error_until) == (T0 + ttl, None)
    # What the planner makes of it: A is still a spot pool, but not an on-demand one.
    spot, _ = rank_pools(obs.offers, stats, r.cfg.capacity, clock(), Market.SPOT)
    on_demand, skipped = rank_pools(obs.offers, stats, r.cfg.capacity, clock(), Market.ON_DEMAND)
    assert A in {p.pool for p in spot}
    assert A not in {p.pool for p in on_demand} and any(s.startswith(f"{A}: capacity error") for s in skipped)

    ec2.no_capacity = {B: "InsufficientInstanceCapacity"}  # A's on-demand shortage is over for EC2
    clock.advance(10)
    report = await r.run_pass()  # spot in A is bought while A's on-demand TTL still runs
    assert [o.status for o in report.outcomes] == ["done"] and [i.pool for i in ec2.live()] == [A]
    clock.advance(10)
    report = await r.run_pass()  # spot in B fails: B blocked for spot only
    assert [o.status for o in report.outcomes] == ["failed"]
    clock.advance(10)
    await r.run_pass()
    stats = planner.seen[4].stats_by_pool()
    assert (stats[B].capacity_error_until, stats[B].on_demand_capacity_error_until) == (T0 + 30 + ttl, None)
    assert stats[A].capacity_error_until is None
    rows = {s.pool: s for s in await r.state.pool_stats()}
    assert (rows[B].capacity_error_until, rows[B].on_demand_capacity_error_until) == (T0 + 30 + ttl, None)
    assert (rows[A].capacity_errors, rows[B].capacity_errors) == (1, 1)
    await r.state.close()


async def test_an_existing_state_db_gains_the_on_demand_column(tmp_path: Path) -> None:
    # A pool_stats table as released before the on-demand TTL existed, with history in it.
    with sqlite3.connect(tmp_path / "fleetd.db") as db:
        db.execute(
            "CREATE TABLE pool_stats (pool TEXT PRIMARY KEY, node_seconds REAL NOT NULL DEFAULT 0,"
            " notices INTEGER NOT NULL DEFAULT 0, losses INTEGER NOT NULL DEFAULT 0,"
            " capacity_errors INTEGER NOT NULL DEFAULT 0, capacity_error_until REAL,"
            " last_error_code TEXT, last_notice_at REAL)"
        )
        db.execute(
            "INSERT INTO pool_stats (pool, node_seconds, notices, capacity_error_until) VALUES (?, 7200, 2, ?)",
            (str(A), T0 + 60),
        )
    db.close()
    for _ in range(2):  # the second open finds the column there already
        store = await StateStore.open(tmp_path)
        (row,) = await store.pool_stats()
        assert (row.node_hours, row.notices, row.capacity_error_until) == (2.0, 2, T0 + 60)
        await store.close()
    store = await StateStore.open(tmp_path)
    await store.mark_pool_unavailable(A, T0 + 120, "InsufficientInstanceCapacity", Market.ON_DEMAND)
    (row,) = await store.pool_stats()
    assert (row.capacity_error_until, row.on_demand_capacity_error_until) == (T0 + 60, T0 + 120)
    await store.close()
