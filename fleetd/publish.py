"""A daemon component that makes each reconcile pass visible: ``/metrics`` and ``status.json``.

Both come from the same facts of the same pass, so Prometheus and ``fleetd status`` never disagree.
Wiring (fleetd/commands/run.py)::

    from fleetd.publish import status_component
    plugins = Plugins(components=[status_component()], ...)

The daemon has no per-pass callback for components, so this one watches ``ctx.last_report``
(set by the daemon's ``on_pass``) a few times a second; a pass is published once, shortly after it
ends. Facts the pass report does not carry yet are read from the reconciler (state DB, intake
observer, training signals); see ``_nodes``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from prometheus_client import REGISTRY

from fleetd.metrics import FleetMetrics, MetricsServer
from fleetd.policy.model import Node, NodePhase
from fleetd.policy.scaling import node_flag
from fleetd.shared.logs import get_logger
from fleetd.snapshot import StatusSnapshot, build_snapshot, write_snapshot

log = get_logger(__name__)

POLL_S = 0.2
RendezvousView = Callable[[], "tuple[int, int] | None"]  # (round, world size in nodes), None: unknown


class RendezvousWatcher:
    """The job's rendezvous round and size, read from the store as a plain client every few
    seconds (read-only: it never writes the state). Call the instance for the latest view."""

    def __init__(
        self,
        host: str,
        port: int,
        run_id: str,
        *,
        interval_s: float = 2.0,
        client_factory: Callable[..., Any] | None = None,
    ) -> None:
        from fleetd.rendezvous.client import RendezvousClient

        self.interval_s = interval_s
        self._connect: Callable[[], Awaitable[Any]] = lambda: (client_factory or RendezvousClient)(
            host, port, run_id
        ).connect()
        self.latest: tuple[int, int] | None = None

    def __call__(self) -> tuple[int, int] | None:
        return self.latest

    async def run(self) -> None:
        from fleetd.rendezvous.errors import RendezvousStateError, RendezvousUnavailable

        client = None
        reported = False
        while True:
            try:
                if client is None:
                    client = await self._connect()
                snap = await client.observe()
                state = snap.state
                self.latest = (
                    None if state is None else (state.round, sum(1 for n in state.participants if not n.is_marker))
                )
                reported = False
            except (RendezvousUnavailable, RendezvousStateError, RuntimeError) as exc:
                # The host may simply not be up yet: say so once per outage, keep trying.
                if not reported:
                    log.warning("rendezvous_view_unavailable", error=str(exc))
                    reported = True
                self.latest = None
                if client is not None:
                    await client.close()
                client = None
            await asyncio.sleep(self.interval_s)


class PassPublisher:
    """Turns one pass (report + reconciler) into metrics and an atomically written snapshot."""

    def __init__(self, cfg: Any, metrics: FleetMetrics, rendezvous: RendezvousView | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.rendezvous = rendezvous
        self._pool_totals: dict[str, dict[str, int]] = {"notices": {}, "capacity_errors": {}}
        self._rebalanced: set[str] = set()
        self._last_plan: Any = None
        self.stall: Any = None  # fleetd.stall_watch.StallWatcher (DaemonContext.stall), when wired in
        self.job: Any = None  # fleetd.job_watch.JobWatcher (DaemonContext.job), when wired in

    async def publish(self, report: Any, reconciler: Any) -> StatusSnapshot:
        nodes = await _nodes(report, reconciler)
        signals = reconciler.signals.snapshot()
        checkpoint = None
        if signals.last_durable_checkpoint_step is not None and signals.last_durable_checkpoint_at is not None:
            checkpoint = (signals.last_durable_checkpoint_step, signals.last_durable_checkpoint_at)
        # A pass cut short before planning (EC2 unreachable) keeps showing the last known budget.
        plan = self._last_plan = report.plan or self._last_plan
        observation = getattr(report, "observation", None)
        stop_issued_at = observation.stop_issued_at if observation is not None else None
        # A team member's caps are its share's (fleetd/team/member.py), as the planner used them.
        caps = getattr(reconciler, "pass_cfg", self.cfg).budget
        # Building (pydantic) and writing are ~30 ms at 2,000 nodes: off the event loop.
        snap = await asyncio.to_thread(
            _build_and_write,
            self.cfg.fleet.state_dir,
            now=report.now,
            fleet=self.cfg.fleet.name,
            reconcile_interval_s=self.cfg.fleet.reconcile_interval_s,
            nodes=nodes,
            budget=plan.budget if plan is not None else None,
            budget_total_usd=caps.total_usd,
            budget_max_usd_per_hour=caps.max_usd_per_hour,
            target_nodes=plan.target_nodes if plan is not None else None,
            rendezvous=self.rendezvous() if self.rendezvous is not None else None,
            checkpoint=checkpoint,
            stop_issued_at=stop_issued_at,
            pools=getattr(reconciler, "pool_rows", ()),
            flags={n.instance_id: f for n in nodes if (f := node_flag(n, self.cfg)) is not None},
            stall=self.stall.latest if self.stall is not None else None,
            job=self.job.view if self.job is not None else None,
            region=self.cfg.aws.region or None,
            capacity_errors=_capacity_errors(observation),
            throughput_by_nodes=observation.throughput_by_nodes if observation is not None else None,
            team_member=self.cfg.team.member,
        )
        self.metrics.observe_snapshot(snap)
        duration = getattr(report, "duration_s", None)
        if duration is not None:
            self.metrics.observe_reconcile(duration)
        await self._count_events(nodes, reconciler)
        return snap

    async def _count_events(self, nodes: Sequence[Node], reconciler: Any) -> None:
        """Notices and capacity errors are counted once each in the state DB (pool_stats); the
        Prometheus counters follow those totals. Rebalances are counted per instance here."""
        for row in await reconciler.state.pool_stats():
            pool = str(row.pool)
            for name, total, count in (
                ("notices", row.notices, self.metrics.count_notice),
                ("capacity_errors", row.capacity_errors, self.metrics.count_capacity_error),
            ):
                seen = self._pool_totals[name].get(pool, 0)
                if total > seen:
                    count(pool, total - seen)
                    self._pool_totals[name][pool] = total
        for n in nodes:
            if n.rebalance_at is not None and n.instance_id not in self._rebalanced:
                self._rebalanced.add(n.instance_id)
                self.metrics.count_rebalance(str(n.pool))


def _capacity_errors(observation: Any) -> dict[str, float]:
    """Each pool's spot capacity error still in force (pool -> until), from the pass's observation."""
    if observation is None:
        return {}
    return {str(s.pool): s.capacity_error_until for s in observation.pool_stats if s.capacity_error_until is not None}


def _build_and_write(state_dir: Any, **facts: Any) -> StatusSnapshot:
    snap = build_snapshot(**facts)
    write_snapshot(state_dir, snap)
    return snap


async def _nodes(report: Any, reconciler: Any) -> list[Node]:
    """The planner's nodes of this pass. Preferred: the pass's own observation (when PassReport
    carries it); otherwise rebuilt from the state DB's open instances and the intake observer."""
    observation = getattr(report, "observation", None)
    if observation is not None:
        return list(observation.nodes)
    nodes = []
    for row in await reconciler.state.instances():  # open rows, ec2_state as of this pass
        node = reconciler.observer.observe(
            Node(
                instance_id=row.instance_id,
                pool=row.pool,
                market=row.market,
                price_per_hour=row.price_per_hour,
                launched_at=row.launched_at,
                ec2_state=row.ec2_state,
                notice_at=row.notice_at,
                max_price_per_hour=row.max_price_per_hour,
                drain_started_at=row.drain_started_at,
            )
        )
        nodes.append(replace(node, phase=_phase(node)))
    return nodes


def _phase(node: Node) -> NodePhase:
    # Same rule as the reconcile loop's (fleetd/reconcile/observe.py, ObservationBuilder._with_phase);
    # only used for a pass that ended before it could observe (its report has no observation).
    if node.ec2_state in ("shutting-down", "terminated"):
        return NodePhase.TERMINATED
    if node.drain_started_at is not None:
        return NodePhase.DRAINING
    if node.running_since is not None or node.last_seen_at is not None:
        return NodePhase.RUNNING
    return NodePhase.PENDING


def status_component(
    *, watch_rendezvous: bool = True, port: int | None = None, on_listening: Callable[[int], None] | None = None
) -> Callable[[Any], Any]:
    """The daemon component: serve /metrics on ``metrics.host:metrics.port`` (``port`` overrides,
    0 = any free port, reported through ``on_listening``), watch the rendezvous round, and publish
    every pass."""

    async def publish_status(ctx: Any) -> None:
        cfg = ctx.cfg
        metrics = FleetMetrics(cfg.fleet.name)
        watcher = None
        if watch_rendezvous:
            r = cfg.rendezvous
            watcher = RendezvousWatcher(r.host, r.port, r.run_id)
        publisher = PassPublisher(cfg, metrics, watcher)
        publisher.stall = getattr(ctx, "stall", None)
        publisher.job = getattr(ctx, "job", None)
        server: MetricsServer | None  # None: /metrics could not be served
        server = MetricsServer(metrics, cfg.metrics.host, cfg.metrics.port if port is None else port, also=(REGISTRY,))
        try:
            await server.start()
        except OSError as exc:
            # The fleet (and its budget) matters more than its dashboard: keep reconciling and
            # writing status.json, and say loudly that /metrics is missing.
            log.error("metrics_unavailable", host=cfg.metrics.host, port=server.port, error=str(exc))
            server = None
        try:
            async with asyncio.TaskGroup() as tg:
                if watcher is not None:
                    tg.create_task(watcher.run(), name="rendezvous-view")
                if server is not None and on_listening is not None:
                    on_listening(server.port)
                await _publish_passes(ctx, publisher)
        finally:
            if server is not None:
                await server.stop()

    return publish_status


async def _publish_passes(ctx: Any, publisher: PassPublisher) -> None:
    last = None
    while True:
        report = ctx.last_report
        if report is not None and report is not last and ctx.reconciler is not None:
            last = report
            try:
                await publisher.publish(report, ctx.reconciler)
            except Exception as exc:  # noqa: BLE001 (CancelledError is not an Exception: it propagates)
                # Status and metrics are for people: a full disk or a bug here must not take the
                # controller (and the fleet's budget enforcement) down. The next pass retries.
                log.error("status_publish_failed", error=repr(exc), exc_info=exc)
        await asyncio.sleep(POLL_S)
