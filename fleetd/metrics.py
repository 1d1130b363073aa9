"""fleetd's Prometheus metrics and the ``/metrics`` endpoint that serves them.

The reconcile loop owns the numbers and pushes them here (fleetd/publish.py does it for the
daemon): ``time_reconcile()`` around a pass, ``observe_snapshot`` after it, ``count_notice``,
``count_rebalance`` and ``count_capacity_error`` as things happen. Each daemon has its own
:class:`CollectorRegistry`, so tests can run several. Updates and scrapes both run on the event
loop: a scrape never sees a half-updated node table. (docs/DESIGN.md "Operations")
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from fleetd.policy.model import BudgetLevel, Node
from fleetd.shared.logs import get_logger
from fleetd.snapshot import StatusSnapshot
from fleetd.stall_record import StallView

log = get_logger(__name__)

# Reconcile passes are ~10 ms with moto and up to seconds against a throttled AWS API; the DESIGN
# target is p99 <= 250 ms at 2,000 agents.
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class FleetMetrics:
    def __init__(
        self, fleet: str, registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self._clock = clock
        self._durable_at: float | None = None
        r = self.registry
        self.nodes = Gauge(
            "fleetd_nodes", "Nodes by planner state, market and pool", ["state", "market", "pool"], registry=r
        )
        self.target_nodes = Gauge("fleetd_target_nodes", "Node count the planner aims for", registry=r)
        self.spent = Gauge("fleetd_budget_spent_usd", "Spend so far (USD)", registry=r)
        self.budget_total = Gauge("fleetd_budget_total_usd", "Configured hard budget cap (USD)", registry=r)
        self.budget_left = Gauge("fleetd_budget_left_usd", "Budget left before the hard cap (USD)", registry=r)
        self.burn_rate = Gauge("fleetd_burn_rate_usd_per_hour", "Current spend rate (USD/h)", registry=r)
        self.forecast = Gauge("fleetd_budget_forecast_usd", "Forecast spend at the planning horizon (USD)", registry=r)
        self.budget_level = Gauge(
            "fleetd_budget_level", "1 for the current graded budget response", ["level"], registry=r
        )
        self.notices = Counter(
            "fleetd_spot_notices", "Spot interruption notices (one per instance) by pool", ["pool"], registry=r
        )
        self.rebalances = Counter(
            "fleetd_rebalance_recommendations",
            "Rebalance recommendations (one per instance) by pool",
            ["pool"],
            registry=r,
        )
        self.capacity_errors = Counter(
            "fleetd_capacity_errors", "Insufficient-capacity errors from EC2 by pool", ["pool"], registry=r
        )
        self.rdzv_round = Gauge("fleetd_rendezvous_round", "Current torchrun rendezvous round", registry=r)
        self.world_size = Gauge("fleetd_rendezvous_world_size", "Nodes in the current rendezvous round", registry=r)
        self.reconcile_duration = Histogram(
            "fleetd_reconcile_duration_seconds", "One observe-plan-act pass", buckets=RECONCILE_BUCKETS, registry=r
        )
        self.checkpoint_step = Gauge(
            "fleetd_checkpoint_durable_step", "Step of the newest durable checkpoint", registry=r
        )
        self.checkpoint_age = Gauge(
            "fleetd_checkpoint_durable_age_seconds", "Age of the newest durable checkpoint (NaN: none yet)", registry=r
        )
        # Computed at scrape time, so the age keeps growing even if the loop stalls.
        self.checkpoint_age.set_function(self._checkpoint_age)
        # The job's lifecycle (fleetd/policy/job_state.py): 1 for the state it is in.
        self.job_state = Gauge("fleetd_job_state", "1 for the job's current state", ["state"], registry=r)
        self.job_restarts = Gauge("fleetd_job_restarts", "Failures of the job's own code restarted so far", registry=r)
        # Stalled-job detection (fleetd/stall_watch.py): billed nodes, no step.
        self.stalled = Gauge(
            "fleetd_job_stalled", "1 while the job is stalled (no step, nodes billed), by cause", ["cause"], registry=r
        )
        self.stalled_for = Gauge(
            "fleetd_job_stalled_seconds",
            "Seconds since the last step of the current stall (0: not stalled)",
            registry=r,
        )
        self.stalls = Gauge("fleetd_job_stalls", "Stalls detected so far (across daemon restarts)", registry=r)
        self.stalled_node_seconds = Gauge(
            "fleetd_stalled_node_seconds", "Billed node-seconds without a step, all stalls so far", registry=r
        )
        Gauge("fleetd_info", "Constant 1, labelled with the fleet", ["fleet"], registry=r).labels(fleet).set(1)

    # -- per pass ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def time_reconcile(self) -> Iterator[None]:
        """Times one pass, failed ones included (a slow failing pass is worth seeing)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.observe_reconcile(time.perf_counter() - start)

    def observe_reconcile(self, seconds: float) -> None:
        self.reconcile_duration.observe(seconds)

    def set_nodes(self, nodes: Iterable[Node]) -> None:
        self._set_node_counts(Tally((str(n.phase), str(n.market), str(n.pool)) for n in nodes))

    def _set_node_counts(self, counts: Tally[tuple[str, str, str]]) -> None:
        # Replace the whole table: a (state, market, pool) that emptied must drop to absent, not linger.
        self.nodes.clear()
        for (state, market, pool), count in counts.items():
            self.nodes.labels(state, market, pool).set(count)

    def set_budget(
        self, *, total_usd: float, spent_usd: float, burn_usd_per_hour: float, forecast_usd: float, level: str
    ) -> None:
        self.budget_total.set(total_usd)
        self.spent.set(spent_usd)
        self.budget_left.set(max(total_usd - spent_usd, 0.0))
        self.burn_rate.set(burn_usd_per_hour)
        self.forecast.set(forecast_usd)
        for known in BudgetLevel:
            self.budget_level.labels(str(known)).set(1 if str(known) == level else 0)

    def set_rendezvous(self, round_: int, world_size: int) -> None:
        self.rdzv_round.set(round_)
        self.world_size.set(world_size)

    def set_durable_checkpoint(self, step: int, durable_at: float) -> None:
        self.checkpoint_step.set(step)
        self._durable_at = durable_at

    def observe_snapshot(self, snap: StatusSnapshot) -> None:
        """Everything the snapshot knows, so /metrics and `fleetd status` always agree."""
        self._set_node_counts(Tally((n.state, n.market, n.pool) for n in snap.nodes if n.state != "terminated"))
        if snap.target_nodes is not None:
            self.target_nodes.set(snap.target_nodes)
        if snap.budget is not None:
            b = snap.budget
            self.set_budget(
                total_usd=b.total_usd,
                spent_usd=b.spent_usd,
                burn_usd_per_hour=b.burn_usd_per_hour,
                forecast_usd=b.forecast_usd,
                level=b.level,
            )
        if snap.rendezvous is not None:
            self.set_rendezvous(snap.rendezvous.round, snap.rendezvous.world_size)
        if snap.checkpoint is not None:
            self.set_durable_checkpoint(snap.checkpoint.step, snap.checkpoint.durable_at)
        if snap.stall is not None:
            self.set_stall(snap.stall, snap.written_at)
        if snap.job is not None:
            self.job_state.clear()
            self.job_state.labels(str(snap.job.state)).set(1)
            self.job_restarts.set(snap.job.restarts)

    def set_stall(self, stall: StallView, now: float) -> None:
        self.stalled.clear()
        current = stall.current
        if current is not None:
            self.stalled.labels(current.cause).set(1)
        self.stalled_for.set(max(0.0, now - current.since) if current is not None else 0.0)
        self.stalls.set(stall.stalls)
        self.stalled_node_seconds.set(stall.stalled_node_seconds)

    # -- as things happen ----------------------------------------------------------------------
    def count_notice(self, pool: str, n: int = 1) -> None:
        self.notices.labels(str(pool)).inc(n)

    def count_rebalance(self, pool: str, n: int = 1) -> None:
        self.rebalances.labels(str(pool)).inc(n)

    def count_capacity_error(self, pool: str, n: int = 1) -> None:
        self.capacity_errors.labels(str(pool)).inc(n)

    # -- exposition ----------------------------------------------------------------------------
    def _checkpoint_age(self) -> float:
        return math.nan if self._durable_at is None else max(self._clock() - self._durable_at, 0.0)

    def render(self, also: Sequence[CollectorRegistry] = ()) -> bytes:
        return generate_latest(merged((self.registry, *also)))


def merged(registries: Sequence[CollectorRegistry]) -> _Merged:
    """Several registries as one exposition (the first to emit a family name wins)."""
    return _Merged(registries)


class Renders(Protocol):
    def render(self, also: Sequence[CollectorRegistry] = ()) -> bytes: ...


class _Merged:
    """Several registries as one exposition; a family name already emitted is skipped (the first
    registry wins), so two modules exporting the same name cannot produce an invalid scrape."""

    def __init__(self, registries: Sequence[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        seen: set[str] = set()
        for registry in self.registries:
            for family in registry.collect():
                if family.name not in seen:
                    seen.add(family.name)
                    yield family


class MetricsServer:
    """``/metrics`` over aiohttp on the daemon's event loop. ``port=0`` binds a free port (tests);
    ``.port`` is the bound one once started. ``also``: more registries to serve (e.g. the default
    one, where the reconcile loop's own counters live)."""

    def __init__(
        self, metrics: Renders, host: str = "127.0.0.1", port: int = 9464, also: Sequence[CollectorRegistry] = ()
    ) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self.also = tuple(also)
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        body = self.metrics.render(self.also)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self) -> MetricsServer:
        app = web.Application()
        app.router.add_get("/metrics", self._handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = runner.addresses[0][1]  # the real port when 0 was asked for
        log.info("metrics_listening", host=self.host, port=self.port)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> MetricsServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
