"""The reconcile pass: observe EC2 and the signals -> ``plan(...)`` -> act through adapters -> record.

Level-based: every pass starts from what EC2 says now, so a missed event, a crash or a restart
costs at most one pass; adapter failures become observations, never crashes (docs/DESIGN.md
"Layers"). This module is the loop and its pass; observe.py builds what the planner sees,
execute.py carries out its actions (and turns adapter failures into outcomes), ledger_feed.py
keeps the budget ledger in step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import Counter, Gauge

from fleetd.adapters.aws_errors import AwsError, Throttled
from fleetd.adapters.ec2 import Ec2Api, Ec2Instance
from fleetd.adapters.pricing import Hardware, PriceSource
from fleetd.config import FleetdConfig
from fleetd.policy.model import Plan, PoolId, Terminate
from fleetd.policy.observation import Observation
from fleetd.reconcile.execute import PERMANENT_HOLD_S, ActionExecutor
from fleetd.reconcile.ledger_feed import LedgerFeed
from fleetd.reconcile.memory_meta import remember
from fleetd.reconcile.observe import ObservationBuilder
from fleetd.reconcile.outcome import ACTIONS, AWS_ERRORS, Outcome, count_aws_error
from fleetd.reconcile.pass_loop import MAX_BACKOFF_S, PassLoop, PassReport
from fleetd.reconcile.pass_schedule import FullPassLimits, UrgentLimits
from fleetd.reconcile.pool_offers import PoolRow
from fleetd.reconcile.ports import (
    Clock,
    LedgerSink,
    LoggingCommander,
    NodeCommander,
    NodeObserver,
    NoObserver,
    NoSignals,
    PassBound,
    SignalSource,
    SpendSource,
)
from fleetd.reconcile.state_port import StateBackend
from fleetd.shared.logs import get_logger

# Outcome, LedgerFeed and the action counters moved out with their code; importable from here still.
__all__ = [
    "ACTIONS",
    "AWS_ERRORS",
    "MAX_BACKOFF_S",
    "NODES",
    "PASSES",
    "PASS_SECONDS",
    "PERMANENT_HOLD_S",
    "LedgerFeed",
    "Outcome",
    "PassReport",
    "Planner",
    "Reconciler",
]

log = get_logger(__name__)

Planner = Callable[[Observation, FleetdConfig, float], Plan]

PASSES = Counter("fleetd_reconcile_passes_total", "Reconcile passes by result", ["result"])
PASS_SECONDS = Gauge("fleetd_reconcile_last_pass_seconds", "Duration of the last reconcile pass")
NODES = Gauge("fleetd_ec2_instances_live", "Pending or running fleet instances seen on EC2 in the last pass")


class Reconciler(PassLoop):
    """One fleet's passes; ``run`` (pass_loop.py) schedules them."""

    def __init__(
        self,
        cfg: FleetdConfig,
        *,
        ec2: Ec2Api,
        prices: PriceSource,
        state: StateBackend,
        pools: Sequence[PoolId],
        hardware: Mapping[str, Hardware],
        planner: Planner,
        clock: Clock = time.time,
        signals: SignalSource | None = None,
        observer: NodeObserver | None = None,
        commander: NodeCommander | None = None,
        ledger: LedgerSink,
        spend: SpendSource | None = None,
        priors: Mapping[PoolId, float] | None = None,
        dry_run: bool = False,
        fence: Callable[[], object] | None = None,
        bound: PassBound | None = None,
    ):
        # Everything a successor (a fresh loop after an HA takeover) is built from.
        self._inputs: dict[str, Any] = dict(
            ec2=ec2,
            prices=prices,
            state=state,
            pools=pools,
            hardware=hardware,
            planner=planner,
            clock=clock,
            signals=signals,
            observer=observer,
            commander=commander,
            spend=spend,
            priors=priors,
            dry_run=dry_run,
            ledger=ledger,
            fence=fence,
            bound=bound,
        )
        self.cfg = cfg
        self.bound = bound
        self._pass_cfg = cfg  # the last full pass's config (inside a team share, when bound)
        self.ec2 = ec2
        self.prices = prices
        self.state = state
        self.pools = tuple(pools)
        self.hardware = dict(hardware)
        self.planner = planner
        self.clock = clock
        self.signals = signals or NoSignals()
        self.observer = observer or NoObserver()
        self.commander = commander or LoggingCommander()
        self.ledger = ledger
        # What the budget sees as spent: the ledger's bills (fleetd.policy.ledger.charge), unless
        # another source of the same bills is given. There is no estimate to fall back on.
        self.spend: SpendSource = spend if spend is not None else ledger
        self.priors = dict(priors or {})
        self.dry_run = dry_run
        self._consecutive_failures = 0  # for the backoff; the rest of the memory is in the state DB
        self._last_obs: Observation | None = None  # the last full pass's, for the urgent pass
        self._notices_planned: int | None = None  # the observer's notice count already planned for
        self.urgent_limits = UrgentLimits()  # the share of a full pass's time urgent passes may take
        self.full_limits = FullPassLimits()  # the share of the loop full passes woken early may take
        self._feed, self._observation, self._executor = self._parts(fence)

    def _parts(
        self, fence: Callable[[], object] | None
    ) -> tuple[LedgerFeed | None, ObservationBuilder, ActionExecutor]:
        """The ledger feed, the observation builder and the executor one pass uses, from this loop's
        inputs (the feed only when this is no dry run)."""
        # A stall is a gap in progress longer than a couple of passes (progress is seen per pass).
        stall_after_s = max(10.0, 2.5 * self.cfg.fleet.reconcile_interval_s)
        feed = LedgerFeed(self.ledger, stall_after_s) if not self.dry_run else None
        observation = ObservationBuilder(
            ec2=self.ec2,
            prices=self.prices,
            state=self.state,
            pools=self.pools,
            hardware=self.hardware,
            signals=self.signals,
            observer=self.observer,
            spend=self.spend,
            priors=self.priors,
            ledger_feed=feed,
        )
        executor = ActionExecutor(
            self.cfg,
            ec2=self.ec2,
            prices=self.prices,
            state=self.state,
            commander=self.commander,
            dry_run=self.dry_run,
            ledger_feed=feed,
            fence=fence,
            clock=self.clock,
        )
        return feed, observation, executor

    def successor(self) -> Reconciler:
        """A loop with the same inputs and none of this one's memory (the ledger resync, the
        drain journal's grace, held actions): what a host runs each time it takes the lease."""
        return Reconciler(self.cfg, **self._inputs)

    # -- one pass -------------------------------------------------------------------------------
    async def run_pass(self) -> PassReport:
        calls = self._executor.calls
        # While the loop runs, the launches and terminations a pass decides are made by their own
        # task (cloud_calls.py); the pass holds its lock from observing to acting, so a call's
        # answer is recorded between passes, never halfway through one.
        async with calls.lock if calls is not None else contextlib.nullcontext():
            return await self._run_pass()

    async def _run_pass(self) -> PassReport:
        now = self.clock()
        started = time.perf_counter()
        self._notices_planned = getattr(self.observer, "notices_seen", None)
        waited0 = getattr(self.ec2, "waited_s", None)
        calls = self._executor.calls
        try:
            obs, live = await self.observe(now)
        except AwsError as exc:
            count_aws_error(exc)
            self._consecutive_failures += 1
            PASSES.labels("observe-failed").inc()
            log.warning("observe_failed", kind=exc.kind, code=exc.code, error=exc.message)
            return PassReport(now, error=exc)
        cfg = self.cfg
        if self.bound is not None:
            obs, cfg = await self.bound.bound(obs, cfg, now)
        self._last_obs, self._pass_cfg = obs, cfg  # the urgent pass plans inside the same bounds
        observed = time.perf_counter()
        # Pure and CPU-bound (~50-100 ms at 2,000 nodes): in a worker thread, so the intake keeps
        # reading (a notice must not sit in the socket while the fleet is planned).
        plan = await asyncio.to_thread(self.planner, obs, cfg, now)
        await self._remember(obs, plan, now)
        planned = time.perf_counter()
        for note in plan.notes:
            log.info("plan_note", note=note)
        # A call the cloud-call task made since the last pass was throttled or failed: this pass
        # makes no EC2 call and reports it, so the loop backs off as if the call had failed in it.
        failed = calls.take_error() if calls is not None else None
        outcomes, error = await self._executor.act(plan, obs, now, urgent_only=failed is not None)
        error = error or failed
        self._consecutive_failures = self._consecutive_failures + 1 if error else 0
        PASSES.labels("throttled" if isinstance(error, Throttled) else "error" if error else "ok").inc()
        took = time.perf_counter() - started
        PASS_SECONDS.set(took)
        NODES.set(len(live))
        # One line per pass: its duration is what a fleet's size costs (bench/agents_load.py);
        # ec2_s is what it awaited EC2 for (0 while the loop runs: the calls have their own task,
        # whose jobs log cloud_call_done).
        waited = getattr(self.ec2, "waited_s", None)
        log.info(
            "pass_done",
            seconds=round(took, 4),
            nodes=len(obs.nodes),
            actions=len(plan.actions),
            error=error.code if error else None,
            ec2_s=round(waited - waited0, 4) if waited is not None and waited0 is not None else None,
            parts={
                **self._observation.last_parts,
                "plan": round(planned - observed, 4),
                "act": round(time.perf_counter() - planned, 4),
            },
        )
        return PassReport(now, plan, tuple(outcomes), tuple(i.instance_id for i in live), error, obs)

    async def run_urgent_pass(self) -> tuple[Outcome, ...]:
        """A notice that arrives while a pass waits on EC2 (a CreateFleet or a TerminateInstances
        takes seconds at fleet scale) must not wait for it: plan again on the last pass's
        observation with the intakes' news folded in (no EC2 call) and carry out the plan's drains
        only. Launches, terminations and checkpoint requests wait for the next full pass, which
        starts as soon as the running one ends. The planner is the same pure function. A notice
        that wakes an idle loop takes the same path first (the full pass's observation costs
        more than the planning at fleet scale)."""
        last = self._last_obs
        seen = getattr(self.observer, "notices_seen", None)
        if last is None or self.dry_run or (seen is not None and seen == self._notices_planned):
            return ()  # woken by something other than a new notice (a status): the pass will do
        self._notices_planned = seen
        now = self.clock()
        obs = await self._observation.refold(last)
        plan = await asyncio.to_thread(self.planner, obs, self._pass_cfg, now)
        outcomes = await self._executor.act_drains(plan, obs, now)
        if outcomes:
            log.info("urgent_pass_done", drains=len(outcomes), seconds=round(self.clock() - now, 4))
        return tuple(outcomes)

    @property
    def pass_cfg(self) -> FleetdConfig:
        """The config the last full pass planned with: a team member's is inside its share."""
        return self._pass_cfg

    @property
    def pool_rows(self) -> tuple[PoolRow, ...]:
        """Every configured pool: its offer, or why it is excluded (as of the last pass)."""
        return self._observation.pool_rows

    async def terminate(self, instance_ids: Sequence[str], reason: str, now: float) -> None:
        """Terminate nodes outside a pass (the stall watcher's last resort), through the same
        executor a pass uses: recorded as ours before the call, ledger fed, dry-run respected.
        The next pass sees them gone and the planner buys replacements."""
        if not instance_ids:
            return
        plan = Plan(actions=tuple(Terminate(reason, iid) for iid in instance_ids))
        await self._executor.act(plan, None, now)  # type: ignore[arg-type]  # terminations read no observation

    # -- observe --------------------------------------------------------------------------------
    async def observe(self, now: float) -> tuple[Observation, list[Ec2Instance]]:
        return await self._observation.observe(now)

    async def _remember(self, obs: Observation, plan: Plan, now: float) -> None:
        """Keep what the stateless planner asked to be kept (fleetd/reconcile/memory_meta.py)."""
        await remember(self.state, self._feed, obs, plan, now, dry_run=self.dry_run)

    # -- act ------------------------------------------------------------------------------------
    async def act(self, plan: Plan, obs: Observation, now: float) -> tuple[list[Outcome], AwsError | None]:
        return await self._executor.act(plan, obs, now)

    # -- the loop -------------------------------------------------------------------------------
