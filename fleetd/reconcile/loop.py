"""The reconcile pass: observe EC2 and the signals -> ``plan(...)`` -> act through adapters -> record.

Level-based: every pass starts from what EC2 says now, so a missed event, a crash or a restart
costs at most one pass. Adapter failures become observations, never crashes:

- a capacity error marks the pool unavailable for ``capacity.capacity_error_ttl_s``;
- throttling (after botocore's own adaptive retries) ends the pass and backs the loop off;
- a transient failure (5xx, network) ends the pass; the next one retries;
- a permanent failure (permissions, bad template, ...) holds that kind of action for a while with
  one clear log line and a metric, instead of repeating the same failing call every pass.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from prometheus_client import Counter, Gauge

from fleetd.adapters.aws_errors import AwsError, CapacityUnavailable, PermanentAwsError, Throttled
from fleetd.adapters.ec2 import Ec2Api, Ec2Instance, LaunchResult, LaunchSpec, launch_token
from fleetd.adapters.pricing import Hardware, PoolPrice, PriceSource
from fleetd.config import FleetdConfig
from fleetd.policy.model import (
    Action,
    BudgetLevel,
    Drain,
    Launch,
    LaunchPurpose,
    Market,
    MarkPoolUnavailable,
    Node,
    NodePhase,
    Plan,
    PoolId,
    PoolOffer,
    RequestCheckpoint,
    StopJob,
    Terminate,
    Warn,
)
from fleetd.policy import ledger
from fleetd.policy.observation import Observation, PoolStats
from fleetd.protocol.logs import get_logger
from fleetd.reconcile import state as st
from fleetd.reconcile.ports import (
    Clock,
    LoggingCommander,
    NodeCommander,
    LedgerSink,
    NodeObserver,
    NoObserver,
    NoSignals,
    SignalSource,
    SpendSource,
)

log = get_logger(__name__)

Planner = Callable[[Observation, FleetdConfig, float], Plan]

AWS_ERRORS = Counter("fleetd_aws_errors_total", "AWS calls that failed, by kind", ["operation", "kind", "code"])
ACTIONS = Counter("fleetd_actions_total", "Planned actions by kind and outcome", ["action", "outcome"])
PASSES = Counter("fleetd_reconcile_passes_total", "Reconcile passes by result", ["result"])
PASS_SECONDS = Gauge("fleetd_reconcile_last_pass_seconds", "Duration of the last reconcile pass")
NODES = Gauge("fleetd_ec2_instances_live", "Pending or running fleet instances seen on EC2 in the last pass")

# How long a permanent failure holds the same kind of action (a config or IAM fix needs a human).
PERMANENT_HOLD_S = 900.0
MAX_BACKOFF_S = 300.0


@dataclass(frozen=True, slots=True)
class Outcome:
    action: Action
    status: str  # done | partial | failed | held | dry-run
    detail: str = ""
    instance_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PassReport:
    now: float
    plan: Plan | None = None
    outcomes: tuple[Outcome, ...] = ()
    live_instances: tuple[str, ...] = ()
    error: AwsError | None = None  # the failure that ended the pass early, if any
    observation: Observation | None = None  # what the planner was shown (None: observe failed)

    @property
    def throttled(self) -> bool:
        return isinstance(self.error, Throttled)


@dataclass
class _Memory:
    """What survives between passes in memory only (everything else is in the state DB)."""

    blocked_until: dict[str, float] = field(default_factory=dict)  # action kind -> time
    logged_permanent: set[tuple[str, str]] = field(default_factory=set)
    consecutive_failures: int = 0


class Reconciler:
    def __init__(
        self,
        cfg: FleetdConfig,
        *,
        ec2: Ec2Api,
        prices: PriceSource,
        state: st.StateStore,
        pools: Sequence[PoolId],
        hardware: Mapping[str, Hardware],
        planner: Planner,
        clock: Clock = time.time,
        signals: SignalSource | None = None,
        observer: NodeObserver | None = None,
        commander: NodeCommander | None = None,
        spend: SpendSource | None = None,
        priors: Mapping[PoolId, float] | None = None,
        dry_run: bool = False,
        ledger: LedgerSink | None = None,
    ):
        self.cfg = cfg
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
        self.spend = spend if spend is not None else ledger
        self.priors = dict(priors or {})
        self.dry_run = dry_run
        self._mem = _Memory()
        self._ledger = LedgerFeed(ledger) if ledger is not None and not dry_run else None

    # -- one pass -------------------------------------------------------------------------------
    async def run_pass(self) -> PassReport:
        now = self.clock()
        started = time.perf_counter()
        try:
            obs, live = await self.observe(now)
        except AwsError as exc:
            self._count_error(exc)
            self._mem.consecutive_failures += 1
            PASSES.labels("observe-failed").inc()
            log.warning("observe_failed", kind=exc.kind, code=exc.code, error=exc.message)
            return PassReport(now, error=exc)
        plan = self.planner(obs, self.cfg, now)
        await self._remember(obs, plan, now)
        for note in plan.notes:
            log.info("plan_note", note=note)
        outcomes, error = await self.act(plan, obs, now)
        self._mem.consecutive_failures = self._mem.consecutive_failures + 1 if error else 0
        PASSES.labels("throttled" if isinstance(error, Throttled) else "error" if error else "ok").inc()
        PASS_SECONDS.set(time.perf_counter() - started)
        NODES.set(len(live))
        return PassReport(now, plan, tuple(outcomes), tuple(i.instance_id for i in live), error, obs)

    # -- observe --------------------------------------------------------------------------------
    async def observe(self, now: float) -> tuple[Observation, list[Ec2Instance]]:
        instances = await self.ec2.list_instances()
        current = [i for i in instances if i.state != "terminated"]
        watched = sorted(set(self.pools) | {i.pool for i in current})
        prices = await self.prices.prices(watched, now)
        await self._resolve_open_launches(instances, now)
        sync = await self.state.sync_instances(
            [self._seen(i, prices.get(i.pool)) for i in instances], now
        )
        for iid in sync.adopted:
            log.info("instance_adopted", instance_id=iid)
        for iid, reason in sync.ended:
            log.info("instance_ended", instance_id=iid, reason=reason)
        signals = self.signals.snapshot()
        rows = {r.instance_id: r for r in await self.state.instances()}
        nodes = []
        notices = []
        for inst in current:
            self.observer.track(inst.instance_id)
            row = rows.get(inst.instance_id)
            node = self._with_phase(self.observer.observe(self._node(inst, row, prices.get(inst.pool))))
            # Only a notice the state has not recorded yet costs a write (2,000 nodes per pass).
            first_notice = node.notice_at is not None and (row is None or row.notice_at is None)
            if first_notice and await self.state.record_notice(node.instance_id, node.notice_at):
                log.info("notice_recorded", instance_id=node.instance_id, pool=str(node.pool), at=node.notice_at)
                notices.append(node.instance_id)
            nodes.append(node)
        if self._ledger is not None:
            await self._ledger.feed(self.state, now, prices, sync, notices)
        obs = Observation(
            nodes=tuple(nodes),
            offers=self._offers(prices),
            pool_stats=await self._pool_stats(),
            spent_usd=await self._spent(now),
            throughput_by_nodes=signals.throughput_by_nodes,
            last_durable_checkpoint_step=signals.last_durable_checkpoint_step,
            last_durable_checkpoint_at=signals.last_durable_checkpoint_at,
            last_checkpoint_request_at=signals.last_checkpoint_request_at,
            target_nodes=await self.state.get_meta("target_nodes"),
            last_scaling_at=await self.state.get_meta("last_scaling_at"),
            rebalance_prebuys_last_hour=await self.state.launches_since(
                str(LaunchPurpose.REBALANCE_PREBUY), now - 3600.0
            ),
            spot_unavailable_since=await self.state.get_meta("spot_unavailable_since"),
            desired_job=signals.desired_job,
            stop_issued_at=await self.state.get_meta("stop_issued_at"),
            budget_level=BudgetLevel(await self.state.get_meta("budget_level", BudgetLevel.NORMAL.value)),
        )
        return obs, [i for i in current if i.live]

    def _seen(self, inst: Ec2Instance, price: PoolPrice | None) -> st.SeenInstance:
        return st.SeenInstance(
            instance_id=inst.instance_id,
            pool=inst.pool,
            market=inst.market,
            ec2_state=inst.state,
            launched_at=inst.launched_at,
            launch_token=inst.launch_token,
            price_per_hour=_price_of(inst.market, price),
            state_reason=inst.state_reason,
        )

    async def _resolve_open_launches(self, instances: Sequence[Ec2Instance], now: float) -> None:
        """An intent still open means fleetd stopped between buying and recording: its instances,
        found by their launch tag, settle it (they are adopted, never bought again)."""
        for row in await self.state.unresolved_launches(since=now - 3600.0):
            mine = [i.instance_id for i in instances if i.launch_token == row.token]
            if mine:
                await self.state.settle_launch(row.token, st.LAUNCHED, mine, now, f"found by tag (was {row.status})")
                log.info("launch_adopted", token=row.token, instances=mine, was=row.status)

    def _node(self, inst: Ec2Instance, row: st.InstanceRow | None, price: PoolPrice | None) -> Node:
        """The planner's view of one instance from EC2 and the state DB (the intakes add theirs)."""
        return Node(
            instance_id=inst.instance_id,
            pool=inst.pool,
            market=inst.market,
            price_per_hour=_price_of(inst.market, price) or (row.price_per_hour if row else 0.0),
            launched_at=inst.launched_at or (row.launched_at if row else 0.0),
            ec2_state=inst.state,
            notice_at=row.notice_at if row else None,
            max_price_per_hour=row.max_price_per_hour if row else None,
            drain_started_at=row.drain_started_at if row else None,
        )

    @staticmethod
    def _with_phase(node: Node) -> Node:
        if node.ec2_state in st.TERMINAL:
            phase = NodePhase.TERMINATED
        elif node.drain_started_at is not None:
            phase = NodePhase.DRAINING
        elif node.running_since is not None or node.last_seen_at is not None:
            phase = NodePhase.RUNNING  # its agent reports
        else:
            phase = NodePhase.PENDING
        return replace(node, phase=phase)

    def _offers(self, prices: Mapping[PoolId, PoolPrice]) -> tuple[PoolOffer, ...]:
        offers = []
        for pool in self.pools:
            price = prices.get(pool)
            hw = self.hardware.get(pool.instance_type)
            if price is None or hw is None or price.on_demand is None:
                continue  # a pool without prices or hardware facts cannot be ranked
            offers.append(
                PoolOffer(
                    pool=pool,
                    gpus=hw.gpus,
                    spot_price=price.spot,
                    on_demand_price=price.on_demand,
                    gpu_model=hw.gpu_model,
                    gpu_memory_gib=hw.gpu_memory_gib,
                    spot_price_trend=price.trend,
                )
            )
        return tuple(offers)

    async def _pool_stats(self) -> tuple[PoolStats, ...]:
        rows = {r.pool: r for r in await self.state.pool_stats()}
        out = []
        for pool in sorted(set(rows) | set(self.pools)):
            r = rows.get(pool)
            out.append(
                PoolStats(
                    pool=pool,
                    node_hours=r.node_hours if r else 0.0,
                    notices=r.notices if r else 0,
                    losses=r.losses if r else 0,
                    capacity_error_until=r.capacity_error_until if r else None,
                    last_notice_at=r.last_notice_at if r else None,
                    prior_interruptions_per_hour=self.priors.get(pool),
                )
            )
        return tuple(out)

    async def _spent(self, now: float) -> float:
        if self.spend is not None:
            return await self.spend.spent_usd(now)
        return await self.state.spend_estimate(now)

    async def _remember(self, obs: Observation, plan: Plan, now: float) -> None:
        """Pass back what the stateless planner asked the caller to keep (observation.py)."""
        if plan.target_nodes is not None and plan.target_nodes != obs.target_nodes:
            log.info("target_changed", previous=obs.target_nodes, target=plan.target_nodes)
            if not self.dry_run:
                await self.state.set_meta("target_nodes", plan.target_nodes)
                await self.state.set_meta("last_scaling_at", now)
        if self.dry_run:
            return
        if plan.budget.level is not obs.budget_level:
            await self.state.set_meta("budget_level", plan.budget.level.value)
        if plan.spot_short and obs.spot_unavailable_since is None:
            await self.state.set_meta("spot_unavailable_since", now)
            log.warning("spot_unavailable", why="no spot pool available for a needed launch")

    # -- act ------------------------------------------------------------------------------------
    async def act(self, plan: Plan, obs: Observation, now: float) -> tuple[list[Outcome], AwsError | None]:
        outcomes: list[Outcome] = []
        # Terminations first and in one call: they free budget and quota for the launches.
        terminations = [a for a in plan.actions if isinstance(a, Terminate)]
        others = [a for a in plan.actions if not isinstance(a, Terminate)]
        try:
            if terminations:
                outcomes += await self._terminate(terminations, now)
            for action in others:
                outcomes.append(await self._act_one(action, obs, now))
        except AwsError as exc:
            # Throttled or transient: stop acting this pass, the loop backs off and re-plans.
            self._count_error(exc)
            log.warning("pass_cut_short", kind=exc.kind, code=exc.code, operation=exc.operation, error=exc.message)
            return outcomes, exc
        return outcomes, None

    async def _act_one(self, action: Action, obs: Observation, now: float) -> Outcome:
        kind = type(action).__name__
        if self._mem.blocked_until.get(kind, 0.0) > now:
            return self._record(Outcome(action, "held", f"{kind} held after a permanent error"))
        if self.dry_run and not isinstance(action, Warn):
            return self._record(Outcome(action, "dry-run"))
        try:
            if isinstance(action, Launch):
                return self._record(await self._launch(action, now))
            if isinstance(action, MarkPoolUnavailable):
                await self.state.mark_pool_unavailable(action.pool, action.until, "planner")
            elif isinstance(action, Drain):
                await self.commander.drain(action.instance_id, action.deadline, action.reason)
                await self.state.mark_drain_started(action.instance_id, now)
            elif isinstance(action, RequestCheckpoint):
                await self.commander.request_checkpoint(action.deadline, action.reason)
            elif isinstance(action, StopJob):
                await self.commander.stop_job(action.reason)
                await self.state.set_meta("stop_issued_at", now)
            elif isinstance(action, Warn):
                log.warning("planner_warning", code=action.code, reason=action.reason)
            else:
                return self._record(Outcome(action, "failed", f"no executor for {kind}"))
        except PermanentAwsError as exc:
            return self._record(self._hold(action, exc, now))
        return self._record(Outcome(action, "done"))

    async def _terminate(self, actions: list[Terminate], now: float) -> list[Outcome]:
        if self._mem.blocked_until.get("Terminate", 0.0) > now:
            return [self._record(Outcome(a, "held", "Terminate held after a permanent error")) for a in actions]
        if self.dry_run:
            return [self._record(Outcome(a, "dry-run")) for a in actions]
        ids = [a.instance_id for a in actions]
        # Recorded before the call: if fleetd dies right after, the termination is still known to
        # be ours and is not counted as an interruption of the pool.
        await self.state.mark_terminate_requested(ids, now)
        try:
            done = set(await self.ec2.terminate(ids))
        except PermanentAwsError as exc:
            return [self._record(self._hold(a, exc, now)) for a in actions]
        return [
            self._record(Outcome(a, "done" if a.instance_id in done else "failed",
                                 "" if a.instance_id in done else "not a fleet instance (refused)",
                                 (a.instance_id,) if a.instance_id in done else ()))
            for a in actions
        ]

    async def _launch(self, action: Launch, now: float) -> Outcome:
        seq = await self.state.settled_launch_count()
        token = launch_token(self.cfg.fleet.name, seq, action.count, action.market, action.pools)
        spec = LaunchSpec(
            token=token,
            count=action.count,
            market=action.market,
            pools=action.pools,
            max_price_per_hour=action.max_price_per_hour if action.market is Market.SPOT else None,
            # EC2 enforces the planner's budget per request: never more per hour than it committed.
            max_total_price=(action.count * action.worst_case_price_per_hour) or None,
        )
        await self.state.record_intent(
            token=token, seq=seq, now=now, count=action.count, market=action.market, pools=action.pools,
            purpose=str(action.purpose), max_price_per_hour=spec.max_price_per_hour, reason=action.reason,
        )
        try:
            result = await self.ec2.launch(spec)
        except CapacityUnavailable as exc:
            # A call-level capacity error does not say which pool: all of them were refused.
            for pool in action.pools:
                await self._pool_failed(pool, exc.code, now)
            await self.state.settle_launch(token, st.FAILED, (), now, f"{exc.code}: {exc.message}")
            await self._spot_outcome(action, got_any=False, now=now)
            self._count_error(exc)
            return Outcome(action, "failed", exc.code)
        except (Throttled, PermanentAwsError) as exc:
            # Definitely not launched: AWS refused the call as a whole.
            await self.state.settle_launch(token, st.FAILED, (), now, f"{exc.code}: {exc.message}")
            raise
        # Transient errors propagate with the intent left open: the call may have gone through,
        # so the next pass resolves it by tag (or re-sends the same token).
        return await self._record_launch(action, spec, result, now)

    async def _record_launch(self, action: Launch, spec: LaunchSpec, result: LaunchResult, now: float) -> Outcome:
        prices = await self.prices.prices(sorted({i.pool for i in result.instances}), now)
        await self.state.record_launched(
            [
                st.SeenInstance(i.instance_id, i.pool, i.market, i.state, i.launched_at or now, spec.token,
                                _price_of(i.market, prices.get(i.pool)) or action.budgeted_price_per_hour)
                for i in result.instances
            ],
            spec.max_price_per_hour,
            now,
        )
        ids = tuple(i.instance_id for i in result.instances)
        if self._ledger is not None:
            await self._ledger.started(await self.state.instances(), ids, prices)
        for f in result.failures:
            self._count_error(AwsError("CreateFleet", f.code, f.message), kind=f.kind)
            if f.kind == "capacity" and f.pool is not None:
                await self._pool_failed(f.pool, f.code, now)
            else:
                log.warning("launch_pool_error", pool=str(f.pool), code=f.code, kind=f.kind, error=f.message)
        status = st.LAUNCHED if ids else st.FAILED
        detail = "; ".join(f"{f.pool}: {f.code}" for f in result.failures)
        await self.state.settle_launch(spec.token, status, ids, now, detail)
        await self._spot_outcome(action, got_any=bool(ids), now=now)
        log.info("launched", token=spec.token, requested=action.count, got=len(ids), instances=list(ids),
                 pools=sorted({str(i.pool) for i in result.instances}), failures=detail or None,
                 already_launched=result.already_launched)
        if len(ids) >= action.count:
            return Outcome(action, "done", instance_ids=ids)
        return Outcome(action, "partial" if ids else "failed", detail, ids)

    async def _pool_failed(self, pool: PoolId, code: str, now: float) -> None:
        until = now + self.cfg.capacity.capacity_error_ttl_s
        await self.state.mark_pool_unavailable(pool, until, code)
        log.warning("pool_unavailable", pool=str(pool), code=code, until=until,
                    ttl_s=self.cfg.capacity.capacity_error_ttl_s)

    async def _spot_outcome(self, action: Launch, *, got_any: bool, now: float) -> None:
        if action.market is not Market.SPOT:
            return
        since = await self.state.get_meta("spot_unavailable_since")
        if got_any and since is not None:
            await self.state.set_meta("spot_unavailable_since", None)
            log.info("spot_available_again", unavailable_for_s=now - since)
        elif not got_any and since is None:
            await self.state.set_meta("spot_unavailable_since", now)
            log.warning("spot_unavailable", pools=[str(p) for p in action.pools])

    def _hold(self, action: Action, exc: PermanentAwsError, now: float) -> Outcome:
        kind = type(action).__name__
        self._mem.blocked_until[kind] = now + PERMANENT_HOLD_S
        self._count_error(exc)
        key = (exc.operation, exc.code)
        if key not in self._mem.logged_permanent:
            self._mem.logged_permanent.add(key)
            log.error("aws_permanent_error", operation=exc.operation, code=exc.code, error=exc.message,
                      action=kind, held_for_s=PERMANENT_HOLD_S,
                      hint="fix the permission/config named above; fleetd retries after the hold")
        return Outcome(action, "held", f"{exc.code}: {exc.message}")

    def _count_error(self, exc: AwsError, kind: str | None = None) -> None:
        AWS_ERRORS.labels(exc.operation, kind or exc.kind, exc.code).inc()

    def _record(self, outcome: Outcome) -> Outcome:
        a = outcome.action
        ACTIONS.labels(type(a).__name__, outcome.status).inc()
        log.info("action", action=type(a).__name__, outcome=outcome.status, reason=a.reason,
                 detail=outcome.detail or None, instances=list(outcome.instance_ids) or None,
                 dry_run=self.dry_run or None)
        return outcome

    # -- the loop -------------------------------------------------------------------------------
    def next_delay(self, report: PassReport) -> float:
        interval = self.cfg.fleet.reconcile_interval_s
        if report.error is None:
            return interval
        # Exponential backoff with jitter, so many controllers do not retry in lockstep.
        backoff = min(interval * (2 ** min(self._mem.consecutive_failures, 10)), MAX_BACKOFF_S)
        return backoff * random.uniform(0.5, 1.0)

    async def run(
        self,
        wake: asyncio.Event,
        passes: int | None = None,
        on_pass: Callable[[PassReport], None] | None = None,
    ) -> None:
        """Run passes until cancelled (or ``passes`` done); ``wake`` starts the next one early;
        ``on_pass`` sees every report (the daemon's watchdog heartbeat)."""
        done = 0
        while passes is None or done < passes:
            # Cleared before the pass: a wake-up that arrives during it starts the next one at once.
            wake.clear()
            report = await self.run_pass()
            done += 1
            if on_pass is not None:
                on_pass(report)
            if passes is not None and done >= passes:
                break
            delay = self.next_delay(report)
            try:
                await asyncio.wait_for(wake.wait(), timeout=delay)
            except TimeoutError:
                pass


class LedgerFeed:
    """Turns what the loop records into budget-ledger events (each with a stable event_id, so a
    re-sent event is stored once). The first pass after a start re-sends everything still open:
    events lost in a crash between the state DB and the ledger are recovered that way."""

    def __init__(self, sink: LedgerSink):
        self.sink = sink
        self._resynced = False
        self._last_price: dict[tuple[PoolId, Market], float] = {}

    async def feed(self, state: st.StateStore, now: float, prices: Mapping[PoolId, PoolPrice],
                   sync: st.SyncReport, notices: Sequence[str]) -> None:
        events: list = []
        if not self._resynced:
            rows = await state.instances(open_only=False)
            started = list(rows)
            stopped = [r for r in rows if r.ended_at is not None]
            noticed = [r for r in rows if r.notice_at is not None]
            self._resynced = True
        else:
            changed = {*sync.adopted, *(i for i, _ in sync.ended), *notices}
            by_id = {r.instance_id: r for r in await state.instances_by_id(sorted(changed))} if changed else {}
            started = [by_id[i] for i in sync.adopted if i in by_id]
            stopped = [by_id[i] for i, _ in sync.ended if i in by_id]
            noticed = [by_id[i] for i in notices if i in by_id]
            rows = await state.instances()
        events += [self._start(r, prices.get(r.pool)) for r in started]
        for r in stopped:
            events.append(ledger.InstanceStopped(at=r.ended_at or now, instance_id=r.instance_id,
                                                 event_id=f"stop:{r.instance_id}"))
            if (r.end_reason or "").startswith("lost"):
                events.append(ledger.Interruption(at=r.ended_at or now, instance_id=r.instance_id, pool=r.pool,
                                                  kind="loss", event_id=f"loss:{r.instance_id}"))
        events += [ledger.Interruption(at=r.notice_at or now, instance_id=r.instance_id, pool=r.pool,
                                       kind="notice", event_id=f"notice:{r.instance_id}") for r in noticed]
        for key in sorted({(r.pool, r.market) for r in rows if r.open}):
            price = _price_of(key[1], prices.get(key[0]))
            if price and self._last_price.get(key) != price:
                self._last_price[key] = price
                events.append(ledger.PriceChanged(at=now, pool=key[0], market=key[1], price_per_hour=price,
                                                  event_id=f"price:{key[0]}:{key[1]}:{now:.3f}"))
        if events:
            await self.sink.append(*events)

    async def started(self, rows: Sequence[st.InstanceRow], ids: Sequence[str],
                      prices: Mapping[PoolId, PoolPrice]) -> None:
        wanted = set(ids)
        events = [self._start(r, prices.get(r.pool)) for r in rows if r.instance_id in wanted]
        if events:
            await self.sink.append(*events)

    @staticmethod
    def _start(r: st.InstanceRow, price: PoolPrice | None) -> object:
        on_demand = price.on_demand if price and price.on_demand else r.price_per_hour
        return ledger.InstanceStarted(at=r.launched_at, instance_id=r.instance_id, pool=r.pool, market=r.market,
                                      price_per_hour=r.price_per_hour, on_demand_price_per_hour=on_demand,
                                      event_id=f"start:{r.instance_id}")


def _price_of(market: Market, price: PoolPrice | None) -> float:
    if price is None:
        return 0.0
    value = price.spot if market is Market.SPOT else price.on_demand
    return value or 0.0

