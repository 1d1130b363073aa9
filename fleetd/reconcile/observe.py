"""Observe: EC2's instances, the state DB, the intake observer and the signals -> the planner's
Observation for one pass.

On the way it keeps the state DB in step with EC2 (adopts instances, ends the gone ones, records
first notices, settles launch intents a crash left open) and feeds the budget ledger.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from fleetd.adapters.ec2 import Ec2Api, Ec2Instance
from fleetd.adapters.pricing import Hardware, PoolPrice, PriceSource
from fleetd.policy.model import LaunchPurpose, Node, NodePhase, PoolId, PoolOffer, node_with
from fleetd.policy.observation import Observation, PoolStats
from fleetd.reconcile import state as st
from fleetd.reconcile.ledger_feed import LedgerFeed
from fleetd.reconcile.memory_meta import load_memory
from fleetd.reconcile.pool_offers import ExclusionLog, PoolRow, pool_rows
from fleetd.reconcile.ports import NodeObserver, SignalSource, SpendSource
from fleetd.reconcile.prices import price_of
from fleetd.reconcile.state_port import StateBackend
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

FORGET_AFTER_S = 3600.0


class ObservationBuilder:
    """Builds each pass's Observation (and the live instances) from EC2 and fleetd's own records."""

    def __init__(
        self,
        *,
        ec2: Ec2Api,
        prices: PriceSource,
        state: StateBackend,
        pools: Sequence[PoolId],
        hardware: Mapping[str, Hardware],
        signals: SignalSource,
        observer: NodeObserver,
        spend: SpendSource,
        priors: Mapping[PoolId, float],
        ledger_feed: LedgerFeed | None,
    ):
        self.ec2 = ec2
        self.prices = prices
        self.state = state
        self.pools = tuple(pools)
        self.hardware = hardware
        self.signals = signals
        self.observer = observer
        self.spend = spend
        self.priors = priors
        self._ledger = ledger_feed
        self.pool_rows: tuple[PoolRow, ...] = ()  # the last pass's offers and exclusions
        self._exclusions = ExclusionLog()
        self._purposes: dict[str, LaunchPurpose | None] = {}  # launch token -> why it was bought
        self._ended: dict[str, float] = {}  # instance -> when the state DB closed it
        # Launch tokens whose CreateFleet is in the cloud-call task (loop.py sets it): their
        # instances are recorded by that job, with their bid, not adopted or settled by tag here.
        self.in_flight: Callable[[], set[str]] = set
        # Seconds each part of the last observation took (the pass logs them: where a pass goes).
        self.last_parts: dict[str, float] = {}

    def _forget_ended(self, now: float) -> None:
        """The registry keeps a record per instance it ever heard of; a week of churn is
        thousands (bench/long_run.py). An instance ended FORGET_AFTER_S ago is forgotten there:
        its bill is in the ledger and the state DB, and its late messages (a last will) are in."""
        forget = getattr(self.observer, "forget", None)
        for iid, at in list(self._ended.items()):
            if now - at >= FORGET_AFTER_S:
                del self._ended[iid]
                if forget is not None:
                    forget(iid)

    async def observe(self, now: float) -> tuple[Observation, list[Ec2Instance]]:
        mark = _Marks()
        instances = await self.ec2.list_instances()
        flying = self.in_flight()
        if flying:
            instances = [i for i in instances if i.launch_token not in flying]
        current = [i for i in instances if i.state != "terminated"]
        watched = sorted(set(self.pools) | {i.pool for i in current})
        prices = await self.prices.prices(watched, now)
        mark("ec2_prices")
        await self._resolve_open_launches(instances, now)
        sync = await self.state.sync_instances([self._seen(i, prices.get(i.pool)) for i in instances], now)
        for iid in sync.adopted:
            log.info("instance_adopted", instance_id=iid)
        for iid, reason in sync.ended:
            log.info("instance_ended", instance_id=iid, reason=reason)
            self._ended[iid] = now
        self._forget_ended(now)
        mark("sync")
        signals = self.signals.snapshot()
        await self._learn_purposes(current)
        rows = {r.instance_id: r for r in await self.state.instances()}
        nodes = []
        notices = []
        for inst in current:
            self.observer.track(inst.instance_id)
            row = rows.get(inst.instance_id)
            node = self._with_phase(self.observer.observe(self._node(inst, row, prices.get(inst.pool))))
            # Only a notice the state has not recorded yet costs a write (2,000 nodes per pass).
            notice_at = node.notice_at
            first_notice = notice_at is not None and (row is None or row.notice_at is None)
            if first_notice and notice_at is not None and await self.state.record_notice(node.instance_id, notice_at):
                log.info("notice_recorded", instance_id=node.instance_id, pool=str(node.pool), at=node.notice_at)
                notices.append(node.instance_id)
            nodes.append(node)
        mark("nodes")
        if self._ledger is not None:
            await self._ledger.feed(self.state, now, prices, sync, notices)
            await self._ledger.progress(nodes, now, {t: hw.gpus for t, hw in self.hardware.items()})
        mark("ledger")
        # The start of a deadline job's progress line: the first pass, kept across restarts.
        started = await self.state.get_meta("job_started_at")
        if started is None:
            started = now
            await self.state.set_meta("job_started_at", now)
        memory = await load_memory(self.state)
        obs = Observation(
            nodes=tuple(nodes),
            offers=self._offers(prices),
            pool_stats=await self._pool_stats(),
            spent_usd=await self._spent(now),
            throughput_by_nodes=signals.throughput_by_nodes,
            last_durable_checkpoint_step=signals.last_durable_checkpoint_step,
            last_durable_checkpoint_at=signals.last_durable_checkpoint_at,
            last_checkpoint_request_at=signals.last_checkpoint_request_at,
            target_nodes=memory.target_nodes,
            last_scaling_at=memory.last_scaling_at,
            rebalance_prebuys_last_hour=await self.state.launches_since(
                str(LaunchPurpose.REBALANCE_PREBUY), now - 3600.0
            ),
            spot_unavailable_since=memory.spot_unavailable_since,
            desired_job=signals.desired_job,
            stop_issued_at=memory.stop_issued_at,
            stop_completed_at=signals.stop_completed_at,
            budget_level=memory.budget_level,
            job_started_at=started,
            code_digest=signals.code_digest,
        )
        mark("stats_meta")
        self.last_parts = mark.parts
        return obs, [i for i in current if i.live]

    async def refold(self, last: Observation) -> Observation:
        """``last`` with the intakes' news since (notices above all) and the state DB's drains
        folded into its nodes: no EC2 call, no write. For the urgent pass (loop.py), which acts
        on drains only: with a registry, only the nodes whose notice or rebalance news is newer
        than ``last`` are folded again (at 2,000 nodes, re-reading and re-folding every node was
        most of a notice's path: 0.05-0.6 s on this loaded box)."""
        record = getattr(self.observer, "record", None)
        if record is None:
            news = list(last.nodes)
        else:
            news = [n for n in last.nodes if _has_news(n, record(n.instance_id))]
        if not news:
            return last
        rows = {r.instance_id: r for r in await self.state.instances_by_id([n.instance_id for n in news])}
        folded: dict[str, Node] = {}
        for node in news:
            row = rows.get(node.instance_id)
            if row is not None:
                node = node_with(
                    node,
                    drain_started_at=row.drain_started_at,
                    notice_at=node.notice_at if node.notice_at is not None else row.notice_at,
                )
            folded[node.instance_id] = self._with_phase(self.observer.observe(node))
        return replace(last, nodes=tuple(folded.get(n.instance_id, n) for n in last.nodes))

    def _seen(self, inst: Ec2Instance, price: PoolPrice | None) -> st.SeenInstance:
        return st.SeenInstance(
            instance_id=inst.instance_id,
            pool=inst.pool,
            market=inst.market,
            ec2_state=inst.state,
            launched_at=inst.launched_at,
            launch_token=inst.launch_token,
            price_per_hour=price_of(inst.market, price),
            state_reason=inst.state_reason,
            ended_at=inst.ended_at,
        )

    async def _resolve_open_launches(self, instances: Sequence[Ec2Instance], now: float) -> None:
        """An intent still open means fleetd stopped between buying and recording: its instances,
        found by their launch tag, settle it (they are adopted, never bought again)."""
        for row in await self.state.unresolved_launches(since=now - 3600.0):
            mine = [i.instance_id for i in instances if i.launch_token == row.token]
            if mine:
                await self.state.settle_launch(row.token, st.LAUNCHED, mine, now, f"found by tag (was {row.status})")
                log.info("launch_adopted", token=row.token, instances=mine, was=row.status)

    async def _learn_purposes(self, instances: Sequence[Ec2Instance]) -> None:
        """Why each launch token was bought, read again only when an instance carries a token
        not seen yet (a pass over 2,000 nodes reads the launches table once per new launch).
        Only the tokens the current instances carry are kept: the map is as large as the fleet,
        not as its history (it grew by one entry per launch for as long as the daemon ran)."""
        carried = {i.launch_token for i in instances if i.launch_token}
        if not carried <= self._purposes.keys():
            for row in await self.state.launches():
                if row.token not in carried:
                    continue
                try:
                    self._purposes[row.token] = LaunchPurpose(row.purpose)
                except ValueError:  # a purpose written by a newer fleetd: unknown, not a crash
                    log.warning("launch_purpose_unknown", token=row.token, purpose=row.purpose)
            for token in carried:  # a token the state never recorded: unknown, not asked again
                self._purposes.setdefault(token, None)
        if len(self._purposes) > len(carried):
            self._purposes = {t: p for t, p in self._purposes.items() if t in carried}

    def _node(self, inst: Ec2Instance, row: st.InstanceRow | None, price: PoolPrice | None) -> Node:
        """The planner's view of one instance from EC2 and the state DB (the intakes add theirs)."""
        return Node(
            instance_id=inst.instance_id,
            pool=inst.pool,
            market=inst.market,
            price_per_hour=price_of(inst.market, price) or (row.price_per_hour if row else 0.0),
            launched_at=inst.launched_at or (row.launched_at if row else 0.0),
            ec2_state=inst.state,
            notice_at=row.notice_at if row else None,
            max_price_per_hour=row.max_price_per_hour if row else None,
            drain_started_at=row.drain_started_at if row else None,
            launch_purpose=self._purposes.get(inst.launch_token or ""),
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
        return node if node.phase is phase else node_with(node, phase=phase)

    def _offers(self, prices: Mapping[PoolId, PoolPrice]) -> tuple[PoolOffer, ...]:
        """An offer per configured pool, or an exclusion with its reason (logged once, kept in
        ``pool_rows`` for status.json): never a silent drop."""
        self.pool_rows = pool_rows(self.pools, prices, self.hardware)
        self._exclusions.update(self.pool_rows)
        return tuple(r.offer for r in self.pool_rows if r.offer is not None)

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
                    on_demand_capacity_error_until=r.on_demand_capacity_error_until if r else None,
                    last_notice_at=r.last_notice_at if r else None,
                    prior_interruptions_per_hour=self.priors.get(pool),
                )
            )
        return tuple(out)

    async def _spent(self, now: float) -> float:
        # The ledger's bills (fleetd.policy.ledger.charge), never an estimate of them.
        return await self.spend.spent_usd(now)


def _has_news(node: Node, rec: object) -> bool:
    """The registry knows of a notice or a rebalance recommendation ``node`` does not show yet."""
    if rec is None:
        return False
    return (getattr(rec, "notice_at", None) is not None and node.notice_at is None) or (
        getattr(rec, "rebalance_at", None) is not None and node.rebalance_at is None
    )


class _Marks:
    """Seconds between successive marks, by name."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.parts[name] = round(now - self._last, 4)
        self._last = now
