"""The ``fleetd run`` process: the reconcile loop plus pluggable components, one TaskGroup.

Components are ``async def run(ctx: DaemonContext) -> None`` coroutines that other parts of
fleetd provide (MQTT intake, SQS consumer, metrics server, rendezvous steering). They share
``ctx.wake`` to start a reconcile pass early (a notice must not wait for the next interval).

Shutdown: SIGTERM or SIGINT sets ``stopping``; every task is cancelled and given
``shutdown_timeout_s`` to finish. The loop never leaves a half-written record behind: intents are
written before a launch and resolved by tag after a restart, so being cancelled mid-pass is safe.
Training does not depend on this process (the rendezvous store lives in its own process).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from tenacity import RetryCallState

from fleetd.adapters.aws_errors import AwsError
from fleetd.config import FleetdConfig
from fleetd.gc_pacing import GcPacing
from fleetd.reconcile.build import Built, build_reconciler, ec2_client_kwargs, pricing_client_kwargs
from fleetd.reconcile.loop import PassReport, Planner, Reconciler
from fleetd.reconcile.ports import Clock, NodeCommander, NodeObserver, SignalSource
from fleetd.shared.backoff import failure_of, retrying
from fleetd.shared.logs import get_logger
from fleetd.shared.sdnotify import Heartbeat, Notifier, watchdog

log = get_logger(__name__)


@dataclass
class DaemonContext:
    cfg: FleetdConfig
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # set to start a pass now
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    reconciler: Reconciler | None = None
    last_report: PassReport | None = None
    stall: Any = None  # fleetd.stall_watch.StallWatcher, when wired in (status and metrics read it)
    job: Any = None  # fleetd.job_watch.JobWatcher, when wired in (status reads it)
    moved_to: str | None = None  # a team move ended: `fleetd run` starts again in this region

    def wake_loop(self) -> None:
        """Callable from intake code (e.g. NodeRegistry(wake=ctx.wake_loop))."""
        self.wake.set()

    def move_to(self, region: str) -> None:
        """The job's objects are in ``region``'s bucket (fleetd/team/region_mover.py): stop, so that
        `fleetd run` starts the daemon again there."""
        log.warning("daemon_restarts_in_region", region=region)
        self.moved_to = region
        self.stopping.set()


Component = Callable[[DaemonContext], Coroutine[Any, Any, None]]


@dataclass
class Plugins:
    """What the rest of fleetd plugs into the daemon (all optional)."""

    components: Sequence[Component] = ()
    # Components that act on the fleet (steering, commands, stall recovery): with HA they run only
    # while this host leads; without, they are ordinary components.
    leader_components: Sequence[Component] = ()
    ha: Any = None  # fleetd.ha.compose.HaParts when [ha] backend = "dynamodb"
    state: Any = None  # a state backend to use instead of the default (an HA dry run's private copy)
    observer: NodeObserver | None = None
    signals: SignalSource | None = None
    commander: NodeCommander | None = None
    ledger: Any = None


STARTUP_RETRY_FIRST_S = 5.0
STARTUP_RETRY_MAX_S = 300.0


class _Stop(Exception):
    """Raised inside the TaskGroup to cancel every task on a shutdown signal."""


async def run_daemon(
    cfg: FleetdConfig,
    *,
    planner: Planner,
    plugins: Plugins | None = None,
    dry_run: bool = False,
    passes: int | None = None,
    clock: Clock = time.time,
    shutdown_timeout_s: float = 20.0,
    session: Any = None,
    ctx: DaemonContext | None = None,
) -> int:
    """Run until SIGTERM/SIGINT (or ``passes`` reconcile passes); returns the exit status."""
    from aiobotocore.session import get_session

    plugins = plugins or Plugins()
    ctx = ctx or DaemonContext(cfg)
    notifier = Notifier.from_environment()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, ctx, sig)
    session = session or get_session()
    if cfg.aws.profile:
        session.set_config_variable("profile", cfg.aws.profile)
    try:
        async with contextlib.AsyncExitStack() as clients:
            client = await clients.enter_async_context(session.create_client("ec2", **ec2_client_kwargs(cfg)))
            # On-demand prices come from the Price List API unless a file book is configured.
            pricing = None
            if cfg.capacity.price_book is None and cfg.capacity.on_demand_prices == "price-list":
                pricing = await clients.enter_async_context(
                    session.create_client("pricing", **pricing_client_kwargs(cfg))
                )
            built = await _build_until_ready(
                ctx,
                lambda: build_reconciler(
                    cfg,
                    client,
                    planner=planner,
                    clock=clock,
                    dry_run=dry_run,
                    signals=plugins.signals,
                    observer=plugins.observer,
                    commander=plugins.commander,
                    ledger=plugins.ledger,
                    pricing_client=pricing,
                    listing_process=True,
                    state=plugins.ha.state if plugins.ha is not None else plugins.state,
                    fence=plugins.ha.election.generation if plugins.ha is not None else None,
                ),
            )
            if built is None:
                return 0  # asked to stop before the first pass could start
            ctx.reconciler = built.reconciler
            mover = getattr(built.reconciler.bound, "mover", None)  # a team member's (fleetd/team/member.py)
            if mover is not None:
                mover.on_move = ctx.move_to
            try:
                extra = (built.ec2_view.run,) if built.ec2_view is not None else ()
                return await _supervise(ctx, built.reconciler, plugins, notifier, passes, shutdown_timeout_s, extra)
            finally:
                if plugins.ha is not None:
                    await plugins.ha.election.release()  # a clean stop hands over at once
                if mover is not None:
                    await mover.close()
                await built.close()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _build_until_ready(ctx: DaemonContext, build: Callable[[], Awaitable[Built]]) -> Built | None:
    """Start-up needs EC2 (pools, launch template). A failure there (no permission yet, AWS
    throttling, a network blip) is logged once per distinct error and retried with backoff
    instead of exiting: exiting would make systemd restart us in a crash loop."""
    last: tuple[str, str] | None = None

    def blocked(state: RetryCallState) -> None:
        nonlocal last
        exc = failure_of(state)
        assert isinstance(exc, AwsError)
        if (exc.operation, exc.code) != last:
            log.error(
                "startup_blocked",
                operation=exc.operation,
                code=exc.code,
                kind=exc.kind,
                error=exc.message,
                retry_in_s=state.upcoming_sleep,
            )
            last = (exc.operation, exc.code)

    try:
        async for attempt in retrying(
            STARTUP_RETRY_FIRST_S, STARTUP_RETRY_MAX_S, retry_on=AwsError, stop=ctx.stopping, before_sleep=blocked
        ):
            if ctx.stopping.is_set():  # it came during the wait
                return None
            with attempt:
                return await build()
    except AwsError:
        if not ctx.stopping.is_set():
            raise
    return None


def _on_signal(ctx: DaemonContext, sig: signal.Signals) -> None:
    log.info("shutdown_requested", signal=sig.name)
    ctx.stopping.set()


async def _supervise(
    ctx: DaemonContext,
    reconciler: Reconciler,
    plugins: Plugins,
    notifier: Notifier,
    passes: int | None,
    shutdown_timeout_s: float,
    extra: Sequence[Component] = (),
) -> int:
    interval = ctx.cfg.fleet.reconcile_interval_s
    heartbeat = Heartbeat(max_silence_s=max(4 * interval, 120.0))
    pacing = GcPacing()  # full garbage collections between passes (fleetd/gc_pacing.py)

    def on_pass(report: PassReport) -> None:
        ctx.last_report = report
        heartbeat.beat()
        pacing.after_pass()

    ha = plugins.ha
    components = list(plugins.components)
    if ha is None:
        components += plugins.leader_components
    else:

        async def standby_step() -> None:
            await ha.refresh()  # warm: the shared state as of one lease step ago
            heartbeat.beat()  # a standby is healthy while its lease steps run
            pacing.after_pass()

        ha.election.on_standby = standby_step

        async def election(ctx: DaemonContext) -> None:
            await ha.election.run(ctx.stopping)

        components.append(election)

    async def reconcile() -> None:
        pacing.install()
        try:
            if ha is None:
                await reconciler.run(ctx.wake, passes=passes, on_pass=on_pass)
            else:
                from fleetd.ha.leadership import lead

                await lead(ctx, ha.election, ha.refresh, reconciler, plugins.leader_components, on_pass, passes)
        finally:
            pacing.uninstall()
        if passes is not None:
            ctx.stopping.set()  # a bounded run (tests, --once style) ends the daemon

    async def group() -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(reconcile(), name="reconcile")
                tg.create_task(watchdog(notifier, heartbeat), name="watchdog")
                for component in (*extra, *components):
                    tg.create_task(component(ctx), name=getattr(component, "__name__", "component"))
                notifier.ready("reconciling")
                log.info(
                    "daemon_started",
                    fleet=ctx.cfg.fleet.name,
                    components=len(components),
                    ha=ha.election.holder if ha is not None else None,
                )
                await ctx.stopping.wait()
                raise _Stop
        except* _Stop:
            pass

    return await _until_stopped(asyncio.create_task(group(), name="fleetd"), ctx, notifier, shutdown_timeout_s)


async def _until_stopped(
    task: asyncio.Task[None], ctx: DaemonContext, notifier: Notifier, shutdown_timeout_s: float
) -> int:
    """Wait for the daemon's task group to end, or for a stop; then give it at most
    ``shutdown_timeout_s`` to wind down. The exit status: 0 on a clean stop."""
    stop_wait = asyncio.create_task(ctx.stopping.wait())
    try:
        await asyncio.wait({task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        # Cancelled from outside (an embedding test or program): stop the children, then obey.
        stop_wait.cancel()
        task.cancel()
        await asyncio.wait({task}, timeout=shutdown_timeout_s)
        raise
    if task.done():
        stop_wait.cancel()
        return _exit_status(task)
    notifier.stopping("shutting down")
    # Bounded: a component stuck in a blocking call must not hold the unit past its stop timeout.
    done, _ = await asyncio.wait({task}, timeout=shutdown_timeout_s)
    if not done:
        log.error("shutdown_timeout", timeout_s=shutdown_timeout_s)
        task.cancel()
        return 1
    status = _exit_status(task)
    log.info("daemon_stopped", status=status)
    return status


def _exit_status(task: asyncio.Task[None]) -> int:
    if task.cancelled():
        return 1
    exc = task.exception()
    if exc is None:
        return 0
    log.error("daemon_failed", error=repr(exc), exc_info=exc)
    return 1
