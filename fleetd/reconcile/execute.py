"""Act: carry out one plan's actions through EC2, the state DB and the node commander.

Drains and checkpoint requests go first; then terminations, in one call; then the other actions
in plan order. While the loop runs, CreateFleet and TerminateInstances are made by the cloud-call
task (cloud_calls.py) and the pass does not wait for them. An adapter failure is turned into an
Outcome (capacity error: the pool is marked unavailable for the launch's market; permanent error:
that kind of action is held for PERMANENT_HOLD_S) or, when throttled or transient, ends acting.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from fleetd.adapters.aws_errors import AwsError, PermanentAwsError
from fleetd.adapters.ec2 import Ec2Api, LaunchResult, LaunchSpec, launch_token
from fleetd.adapters.pricing import PriceSource
from fleetd.config import FleetdConfig
from fleetd.policy.memory import after_stop
from fleetd.policy.model import (
    Action,
    Drain,
    Launch,
    Market,
    MarkPoolUnavailable,
    Plan,
    RequestCheckpoint,
    StopJob,
    Terminate,
    Warn,
)
from fleetd.policy.observation import Observation
from fleetd.reconcile import journal
from fleetd.reconcile import state as st
from fleetd.reconcile.cloud_calls import CloudCalls, Job
from fleetd.reconcile.launch_book import LaunchBook
from fleetd.reconcile.ledger_feed import LedgerFeed
from fleetd.reconcile.memory_meta import load_memory, store_memory
from fleetd.reconcile.outcome import ACTIONS, Outcome, count_aws_error
from fleetd.reconcile.ports import NodeCommander, NotDelivered
from fleetd.reconcile.state_port import StateBackend
from fleetd.shared.failpoints import failpoint
from fleetd.shared.keyed_locks import KeyedLocks
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

# How long a permanent failure holds the same kind of action (a config or IAM fix needs a human).
PERMANENT_HOLD_S = 900.0
# A drain recorded but not known to be sent is re-sent only after the agent had this long (since
# the record, and since this process started) to say "draining": its retained status arrives
# within a second of fleetd (re)connecting to the broker, so a drain it got is not sent twice.
DRAIN_RESEND_GRACE_S = 10.0
# A termination still running this long after fleetd asked for it is asked for again.
TERMINATE_RESEND_AFTER_S = 30.0


class ActionExecutor:
    """Executes plans; remembers in memory which kinds of action a permanent error holds."""

    def __init__(
        self,
        cfg: FleetdConfig,
        *,
        ec2: Ec2Api,
        prices: PriceSource,
        state: StateBackend,
        commander: NodeCommander,
        dry_run: bool,
        ledger_feed: LedgerFeed | None,
        fence: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.cfg = cfg
        self._clock = clock
        # Set while the loop runs (Reconciler.run): launches and terminations are then carried out
        # by its own task (cloud_calls.py) and the pass does not wait on EC2. None (passes driven
        # one by one: tests, the simulator, the benches): every call is awaited in the pass.
        self.calls: CloudCalls | None = None
        # HA (fleetd.ha.election.Election.generation): raises LeaseLost unless this process leads
        # now. Checked right before every EC2 launch/terminate and every command: those cannot be
        # conditioned on the lease in the store the way state writes are.
        self._fence = fence or (lambda: None)
        self.ec2 = ec2
        self.prices = prices
        self.state = state
        self.commander = commander
        self.dry_run = dry_run
        self.launches = LaunchBook(state, prices, ledger_feed, cfg.capacity.capacity_error_ttl_s)
        self._blocked_until: dict[str, float] = {}  # action kind -> time
        self._logged_permanent: set[tuple[str, str]] = set()
        self._started_at: float | None = None  # the first pass's time (the drain re-send grace)
        self._drain_locks = KeyedLocks()  # a node's drain: record, send, mark, one at a time

    async def act(
        self, plan: Plan, obs: Observation, now: float, urgent_only: bool = False
    ) -> tuple[list[Outcome], AwsError | None]:
        """``urgent_only``: drains and checkpoint requests only (the cloud-call task was just
        throttled or failed: no EC2 call this pass, as when the call failed inside it)."""
        outcomes: list[Outcome] = []
        # Drains and checkpoint requests first: a noticed node has two minutes, and they are one
        # MQTT publish / store write each, while the EC2 calls after them take seconds at fleet
        # scale (measured: a notice behind a TerminateInstances waited 0.5-2.5 s at 500 nodes).
        # Then terminations, in one call: they free budget and quota for the launches.
        urgent = [a for a in plan.actions if isinstance(a, (Drain, RequestCheckpoint))]
        terminations = [a for a in plan.actions if isinstance(a, Terminate)]
        if self.calls is not None:
            # Asked already, the call is queued or running: not asked (nor recorded) twice.
            busy = [a for a in terminations if self.calls.terminating(a.instance_id)]
            outcomes += [self._record(Outcome(a, "held", "TerminateInstances in flight")) for a in busy]
            terminations = [a for a in terminations if a not in busy]
        others = [a for a in plan.actions if not isinstance(a, (Terminate, Drain, RequestCheckpoint))]
        try:
            outcomes += await self._drains_together([a for a in urgent if isinstance(a, Drain)], obs, now)
            for action in urgent:
                if not isinstance(action, Drain):
                    outcomes.append(await self._act_one(action, obs, now))
            if urgent_only:
                return outcomes, None
            if not self.dry_run and obs is not None:  # None: terminations outside a pass
                outcomes += await self._finish_unfinished(obs, now, {a.instance_id for a in terminations})
            if terminations:
                outcomes += await self._terminate(terminations, now)
            for other in others:
                outcomes.append(await self._act_one(other, obs, now))
        except AwsError as exc:
            # Throttled or transient: stop acting this pass, the loop backs off and re-plans.
            count_aws_error(exc)
            log.warning("pass_cut_short", kind=exc.kind, code=exc.code, operation=exc.operation, error=exc.message)
            return outcomes, exc
        return outcomes, None

    async def act_drains(self, plan: Plan, obs: Observation, now: float) -> list[Outcome]:
        """Only the plan's drains (the urgent pass: the rest waits for the next full pass)."""
        if self.dry_run:
            return []
        return await self._drains_together([a for a in plan.actions if isinstance(a, Drain)], obs, now)

    async def _drains_together(self, drains: list[Drain], obs: Observation, now: float) -> list[Outcome]:
        """Per node record -> send -> mark (the journal's rule), the nodes side by side: one by one,
        a loaded controller took 1-2 s a drain (bench/agents_load.py), 20-30 s for a wave's last."""
        if len(drains) <= 1:
            return [await self._act_one(a, obs, now) for a in drains]
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(self._act_one(a, obs, now)) for a in drains]
        return [t.result() for t in tasks]

    async def _act_one(self, action: Action, obs: Observation, now: float) -> Outcome:
        kind = type(action).__name__
        if self._blocked_until.get(kind, 0.0) > now:
            return self._record(Outcome(action, "held", f"{kind} held after a permanent error"))
        if self.dry_run and not isinstance(action, Warn):
            return self._record(Outcome(action, "dry-run"))
        try:
            if isinstance(action, Launch):
                return self._record(await self._launch(action, now))
            if isinstance(action, MarkPoolUnavailable):
                await self.state.mark_pool_unavailable(action.pool, action.until, "planner")
            elif isinstance(action, Drain):
                # One node's drain at a time: the urgent pass (loop.py) runs beside a full pass
                # planned before it recorded its drain, and both drained the node; without this,
                # the second read "not sent yet" while the first was still publishing, and the
                # node got the command twice (a full run beside two CPU burners, 2026-11-27).
                async with self._drain_locks.hold(action.instance_id):
                    # Recorded first: from here on the node counts as draining, so no pass (of
                    # this process or the next) plans it again; the journal sends it if this send
                    # is lost.
                    record = await journal.record_drain(
                        self.state, action.instance_id, now, action.deadline, action.reason
                    )
                    failpoint("drain-recorded")
                    if record.sent_at is not None:
                        return self._record(Outcome(action, "done", "already sent"))
                    try:
                        await self._send_drain(record, now)
                    except NotDelivered as exc:
                        return self._record(Outcome(action, "failed", f"{exc}; re-sent by the drain journal"))
                self._log_notice_to_drain(action.instance_id, obs)
            elif isinstance(action, RequestCheckpoint):
                await self.commander.request_checkpoint(action.deadline, action.reason)
            elif isinstance(action, StopJob):
                await self.commander.stop_job(action.reason)
                memory = await load_memory(self.state)
                await store_memory(self.state, memory, after_stop(memory, now))
            elif isinstance(action, Warn):
                log.warning("planner_warning", code=action.code, reason=action.reason)
            else:
                return self._record(Outcome(action, "failed", f"no executor for {kind}"))
        except PermanentAwsError as exc:
            return self._record(self._hold(action, exc, now))
        return self._record(Outcome(action, "done"))

    def _log_notice_to_drain(self, instance_id: str, obs: Observation | None) -> None:
        """How long the node's notice waited for its drain inside fleetd (intake to command
        handed to the broker): where a slow notice path shows first (bench/agents_load.py)."""
        node = next((n for n in obs.nodes if n.instance_id == instance_id), None) if obs is not None else None
        if node is not None and node.notice_at is not None:
            log.info("notice_drained", instance_id=instance_id, since_notice_s=round(self._clock() - node.notice_at, 4))

    async def _terminate(self, actions: list[Terminate], now: float) -> list[Outcome]:
        if self._blocked_until.get("Terminate", 0.0) > now:
            return [self._record(Outcome(a, "held", "Terminate held after a permanent error")) for a in actions]
        if self.dry_run:
            return [self._record(Outcome(a, "dry-run")) for a in actions]
        ids = [a.instance_id for a in actions]
        # Recorded before the call: if fleetd dies right after, the termination is still known to
        # be ours and is not counted as an interruption of the pool (and the journal re-sends it).
        await self.state.mark_terminate_requested(ids, now)
        failpoint("terminate-recorded")
        if self.calls is not None:
            self.calls.submit(
                Job(f"terminate {len(ids)}", lambda: self._terminate_call(actions), instance_ids=frozenset(ids))
            )
            return [self._record(Outcome(a, "started", "TerminateInstances in its own task")) for a in actions]
        return await self._terminate_call(actions)

    async def _terminate_call(self, actions: list[Terminate]) -> list[Outcome]:
        """The call itself (in the pass, or in the cloud-call task): nothing is written after it."""
        ids = [a.instance_id for a in actions]
        self._fence()
        try:
            done = set(await self.ec2.terminate(ids))
        except PermanentAwsError as exc:
            return [self._record(self._hold(a, exc, self._clock())) for a in actions]
        return [
            self._record(
                Outcome(
                    a,
                    "done" if a.instance_id in done else "failed",
                    "" if a.instance_id in done else "not a fleet instance (refused)",
                    (a.instance_id,) if a.instance_id in done else (),
                )
            )
            for a in actions
        ]

    async def _send_drain(self, record: journal.DrainRecord, now: float) -> None:
        self._fence()
        await self.commander.drain(
            record.instance_id, record.deadline, record.reason, msg_id=journal.drain_msg_id(record)
        )
        failpoint("drain-sent")
        await journal.mark_drain_sent(self.state, record.instance_id, now)

    async def _finish_unfinished(self, obs: Observation, now: float, terminating: set[str]) -> list[Outcome]:
        """Drains and terminations a previous pass (or a previous process) decided and may not
        have delivered: see fleetd.reconcile.journal."""
        if self._started_at is None:
            self._started_at = now
        live = {n.instance_id for n in obs.nodes if n.ec2_state not in st.TERMINAL}
        for rec in await journal.unsent_drains(self.state):
            if rec.instance_id not in live or self._drain_locks.busy(rec.instance_id):
                continue  # gone, or its drain is being sent right now
            said = self.commander.node_state(rec.instance_id)
            if said in ("draining", "leaving"):
                await journal.mark_drain_sent(self.state, rec.instance_id, now)
                log.info(
                    "drain_confirmed",
                    instance_id=rec.instance_id,
                    agent_state=said,
                    why="the agent is draining: the recorded drain is not sent again",
                )
            elif now - max(rec.started_at, self._started_at) >= DRAIN_RESEND_GRACE_S:
                try:
                    await self._send_drain(rec, now)
                    log.warning(
                        "drain_resent",
                        instance_id=rec.instance_id,
                        recorded_s_ago=round(now - rec.started_at, 1),
                        why="recorded, never confirmed sent (a crash or the broker was down)",
                    )
                except NotDelivered as exc:
                    log.warning("drain_resend_failed", instance_id=rec.instance_id, error=str(exc))
        overdue = [
            i
            for i in await journal.unfinished_terminations(self.state, now - TERMINATE_RESEND_AFTER_S)
            if i in live and i not in terminating and (self.calls is None or not self.calls.terminating(i))
        ]
        if not overdue:
            return []
        log.warning("terminate_resent", instances=overdue, why="asked for and still running")
        again = [Terminate(reason="finishing a termination fleetd already decided", instance_id=i) for i in overdue]
        if self.calls is not None:
            self.calls.submit(
                Job(
                    f"terminate again {len(overdue)}",
                    lambda: self._terminate_call(again),
                    instance_ids=frozenset(overdue),
                )
            )
            return [self._record(Outcome(a, "started", "TerminateInstances in its own task")) for a in again]
        return await self._terminate_call(again)

    async def _launch(self, action: Launch, now: float) -> Outcome:
        if self.calls is not None and self.calls.launching:
            # The pass cannot see that launch's instances before its call returns: buying now
            # would buy them twice. The pass after it (woken when it ends) plans again.
            return Outcome(action, "held", "a launch is in flight")
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
        self._fence()
        await self.state.record_intent(
            token=token,
            seq=seq,
            now=now,
            count=action.count,
            market=action.market,
            pools=action.pools,
            purpose=str(action.purpose),
            max_price_per_hour=spec.max_price_per_hour,
            reason=action.reason,
        )
        failpoint("launch-recorded")
        if self.calls is not None:
            self.calls.submit(Job(f"launch {token}", lambda: self._launch_call(action, spec), launch=True, token=token))
            return Outcome(action, "started", "CreateFleet in its own task")
        return await self._launch_call(action, spec, now)

    async def _launch_call(self, action: Launch, spec: LaunchSpec, now: float | None = None) -> Outcome:
        """The call and its answer: in the pass (``now`` given), or in the cloud-call task, which
        records the answer under the pass lock, at the time it came."""
        self._fence()
        result: LaunchResult | None = None
        exc: AwsError | None = None
        try:
            result = await self.ec2.launch(spec)
        except AwsError as error:
            exc = error
        if now is not None:
            return await self.launches.answer(action, spec, result, exc, now)
        assert self.calls is not None
        async with self.calls.lock:
            try:
                return self._record(await self.launches.answer(action, spec, result, exc, self._clock()))
            except PermanentAwsError as perm:
                return self._record(self._hold(action, perm, self._clock()))

    def _hold(self, action: Action, exc: PermanentAwsError, now: float) -> Outcome:
        kind = type(action).__name__
        self._blocked_until[kind] = now + PERMANENT_HOLD_S
        count_aws_error(exc)
        key = (exc.operation, exc.code)
        if key not in self._logged_permanent:
            self._logged_permanent.add(key)
            log.error(
                "aws_permanent_error",
                operation=exc.operation,
                code=exc.code,
                error=exc.message,
                action=kind,
                held_for_s=PERMANENT_HOLD_S,
                hint="fix the permission/config named above; fleetd retries after the hold",
            )
        return Outcome(action, "held", f"{exc.code}: {exc.message}")

    def _record(self, outcome: Outcome) -> Outcome:
        a = outcome.action
        ACTIONS.labels(type(a).__name__, outcome.status).inc()
        log.info(
            "action",
            action=type(a).__name__,
            outcome=outcome.status,
            reason=a.reason,
            detail=outcome.detail or None,
            instances=list(outcome.instance_ids) or None,
            dry_run=self.dry_run or None,
        )
        return outcome
