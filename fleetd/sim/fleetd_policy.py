"""fleetd's own policy in the simulator: the daemon's planner, `fleetd.policy.planner.plan`,
driven with a virtual clock.

The simulator plays the parts the daemon's adapters play: it builds the `Observation` the
reconcile loop would build (nodes with their phase and notices, offers, pool history, spend),
calls ``plan(obs, cfg, now)``, and carries out each action the way fleetd's components do
(DESIGN.md "One interruption, end to end"):

- Launch: spot nodes come from the trace's free capacity; a launch that gets fewer than asked is
  a capacity error, which marks the pool unavailable for ``capacity.capacity_error_ttl_s``, as
  the loop does. On-demand always succeeds. A new node joins at the next rendezvous round after a
  coordinated checkpoint, so the re-form loses no steps (cost: stall + re-form for every rank).
- Drain: coordinated checkpoint, the node leaves the rendezvous, survivors re-form in
  ``reform_s``. The node stays DRAINING (billed, idle) until its agent reports that its trainer
  exited (checkpoint + shard upload + leave, `_left_delay_s`): the registry records ``left_at``
  and the planner terminates it at once (DESIGN.md step 4). ``leaving_signal=False`` models an
  agent that never says so: billed until reclaimed or the drain times out.
- One membership change per pass: the joins and leaves a pass decides go through one rendezvous
  round (one coordinated checkpoint, one re-form), as fleetd/rendezvous/decide.py completes a
  round once every survivor and waiting newcomer is in. Event-driven passes are coalesced: the
  notices of one reclaim wave (the same instant) wake one pass, not one each.
- A loss with no notice: the collective hangs until the rendezvous steering drops the silent rank
  and pokes the survivors (``rdzv_dead_after_s``); they save the step they completed
  (agent/trainer/salvage.py: only the step in flight, ``salvage_loss_s``, is lost) and re-form.
  With sharded state (``salvage_loss_s=None``), or when no member survives the instant, the job
  resumes from the last checkpoint instead. The planner learns of the loss later (``detect_s``,
  the MQTT last will) and replaces the node.

Passes run on every event the daemon would be woken by (notice, loss, a drained node reporting
that it left), one reconcile interval after a pass that acted, when a time-driven input of the
planner crosses its threshold (`_schedule_next`), and at the latest every ``tick_s`` (default
`defaults.SIM_PASS_INTERVAL_S`: the daemon's 10 s would make a 24 h trace cost ~8,600 passes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from fleetd.config import FleetdConfig
from fleetd.policy.model import (
    Drain,
    Launch,
    MarkPoolUnavailable,
    Market,
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
from fleetd.policy.checkpointing import cadence
from fleetd.policy.observation import Observation, PoolStats, spot_shortage_over
from fleetd.policy.planner import plan
from fleetd.sim import defaults as d
from fleetd.sim.clock import Timer
from fleetd.sim.engine import ON_DEMAND, SimNode, World

if TYPE_CHECKING:
    from fleetd.sim.deadline_guard import DeadlineGuard

Planner = Callable[[Observation, FleetdConfig, float], Plan]


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """One executed action, in a form the daemon's loop can be compared with."""

    t: float
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.t:.0f}s {self.kind} {self.detail}"


def describe(action) -> tuple[str, str]:
    """(kind, detail) of an action, without its free-text reason."""
    kind = type(action).__name__
    if isinstance(action, Launch):
        return kind, f"{action.count} {action.market.value} {action.purpose.value}"
    if isinstance(action, (Drain, Terminate)):
        return kind, action.instance_id
    if isinstance(action, MarkPoolUnavailable):
        return kind, str(action.pool)
    if isinstance(action, Warn):
        return kind, action.code
    return kind, ""


class FleetdPolicy:
    name = "fleetd"

    def __init__(
        self,
        cfg: FleetdConfig,
        pool: PoolId,
        gpus_per_node: int = 1,
        reform_s: float = d.FLEETD_REFORM_S.value,
        detect_s: float = d.FLEETD_LOSS_DETECT_S.value,
        rdzv_dead_after_s: float = d.FLEETD_RDZV_DEAD_AFTER_S.value,
        salvage_loss_s: float | None = d.SALVAGE_STEP_LOSS_S.value,
        prior_interruptions_per_hour: float | None = None,
        tick_s: float | None = None,
        startup_s: float = 0.0,
        guard: "DeadlineGuard | None" = None,
        leaving_signal: bool = True,
        upload_gb_per_s: float = d.UPLOAD_GB_PER_S.value,
        od_pool: PoolId | None = None,
        planner: Planner = plan,
    ) -> None:
        self.cfg = cfg
        # The trace covers one spot pool. On-demand is offered in a pool of its own (another
        # zone of the region) where it never runs out: EC2's on-demand capacity does not run out
        # with spot capacity, and capacity errors are remembered per market (reconcile/state.py).
        self.od_pool = od_pool or PoolId(pool.instance_type, f"{pool.zone}-on-demand")
        self.planner = planner
        self.startup_s = startup_s  # launch -> agent up and state restored (trace adds: 0)
        self.guard = guard
        # DESIGN.md step 4: the drained node's agent reports that its trainer exited (the
        # registry's left_at); the planner terminates it at once. False: an agent that never
        # reports it (billed until AWS reclaims the node or the drain times out).
        self.leaving_signal = leaving_signal
        self.upload_gb_per_s = upload_gb_per_s
        self._wake_at: float | None = None
        self.left_at: dict[str, float] = {}
        # Membership changes decided in the pass under way (applied as one round at its end).
        self._joining: list[SimNode] | None = None
        self._leaving: list[SimNode] = []
        self._wake: Timer | None = None
        self.pool = pool
        self.gpus = gpus_per_node
        self.reform_s = reform_s
        self.detect_s = detect_s
        self.rdzv_dead_after_s = rdzv_dead_after_s
        self.salvage_loss_s = salvage_loss_s
        self._hung_since: float | None = None  # a member lost at this instant: survivors hang
        self._hung_world = 0
        self.prior = prior_interruptions_per_hour
        self.tick_s = tick_s or d.SIM_PASS_INTERVAL_S.value
        self.phase: dict[str, NodePhase] = {}
        self.node_pool: dict[str, PoolId] = {}  # the launch's first pool, as EC2 fills it first
        self.running_since: dict[str, float] = {}
        self.drain_started: dict[str, float] = {}
        self.target: int | None = None
        self.last_scaling_at: float | None = None
        self.budget_level = None
        self.spot_unavailable_since: float | None = None
        self.capacity_error_until: float | None = None
        self.stop_issued_at: float | None = None
        self.last_durable_at: float | None = None
        self.last_durable_step: int | None = None
        self.last_request_at: float | None = None
        self.notices = 0
        self.losses = 0
        self.last_notice_at: float | None = None
        self.node_s_closed = 0.0
        self.throughput: dict[int, float] = {}
        self.record: list[ActionRecord] = []
        self.passes = 0
        self.pass_times: list[float] = []
        self._tick: Timer | None = None

    # --- world callbacks -----------------------------------------------------------------
    def start(self, world: World) -> None:
        self._pass(world)

    def on_capacity(self, world: World) -> None:
        pass  # the daemon cannot see spot capacity appear; its next launch attempt finds it

    def on_notice(self, world: World, node: SimNode) -> None:
        self.notices += 1
        self.last_notice_at = world.now
        self._wake_now(world)

    def _wake_now(self, world: World) -> None:
        """An urgent event wakes the loop: one pass at this instant, after every other event of
        the same instant (a reclaim wave's notices arrive together and are drained together)."""
        if self._wake is not None and self._wake_at == world.now:
            return  # a pass at this instant is already due
        self._wake_at = world.now
        self._wake = world.queue.at(world.now, lambda: self._pass(world))

    def on_lost(self, world: World, node: SimNode, noticed: bool) -> None:
        self.node_s_closed += world.now - node.acquired_at  # lost nodes are always spot
        phase = self._forget(node.id)
        if not noticed:
            self.losses += 1
        if phase is NodePhase.RUNNING:
            # Still in the collective: every rank hangs until fleetd drops the silent rank.
            self._member_lost(world)
            world.after(self.detect_s, lambda: self._pass(world))
        else:
            self._wake_now(world)

    def _member_lost(self, world: World) -> None:
        """A member left the collective unannounced. The survivors' recovery is settled once
        every loss of this instant is known (a reclaim wave may take them all)."""
        if self._hung_since == world.now:
            return  # the same wave: recovery is already due at this instant
        # The world size of the step in flight: the members now plus the one just lost.
        self._hung_since, self._hung_world = world.now, len(world.members()) + 1
        world.queue.at(world.now, lambda: self._recover(world))

    def _recover(self, world: World) -> None:
        """Hang until the steering pokes the survivors; they save the step they completed (or,
        with none left or sharded state, the job resumes from its last checkpoint); re-form."""
        self._hung_since = None
        world.stall(self.rdzv_dead_after_s, "loss recovery")
        if world.members() and self.salvage_loss_s is not None:
            world.salvage(self._hung_world, self.salvage_loss_s)
            self.last_durable_at, self.last_durable_step = world.now, int(world.progress)
        else:
            world.rollback()
        world.stall(self.reform_s, "loss recovery", after_current=True)

    # --- one reconcile pass --------------------------------------------------------------
    def _pass(self, world: World) -> None:
        if self._wake is not None and self._wake_at == world.now:
            self._wake.cancel()  # this pass is the one it was due for
        self._wake = None
        if world.done:
            return
        now = world.now
        cfg, hide_spot = self.cfg, False
        if self.guard is not None:
            cfg, hide_spot = self.guard.adjust(world, self.cfg, self.spot_unavailable_since)
            if hide_spot and self.spot_unavailable_since is None:
                self.spot_unavailable_since = now  # "no spot pool is offered" counts as none found
        obs = self._observe(world, hide_spot)
        result: Plan = self.planner(obs, cfg, now)
        self.passes += 1
        self.pass_times.append(now)
        if result.target_nodes is not None and result.target_nodes != self.target:
            if self.target is not None:
                self.last_scaling_at = now
            self.target = result.target_nodes
        self.budget_level = result.budget.level
        if result.spot_short and self.spot_unavailable_since is None:
            self.spot_unavailable_since = now  # as the loop remembers it (reconcile/loop.py)
        elif spot_shortage_over(result):
            self.spot_unavailable_since = None  # the shortage ended without a spot launch, as in the loop
        self._joining, self._leaving = [], []
        try:
            for action in result.actions:
                kind, detail = describe(action)
                self.record.append(ActionRecord(now, kind, detail))
                self._execute(world, action)
        finally:
            joining, leaving = self._joining, self._leaving
            self._joining, self._leaving = None, []
        self._membership_round(world, joining, leaving)
        self._schedule_next(world, cfg, acted=bool(result.actions), soon=result.replan_in_s)

    def _schedule_next(self, world: World, cfg: FleetdConfig, acted: bool, soon: float | None = None) -> None:
        """The next pass: one reconcile interval after a pass that acted (the daemon's cadence,
        so it sees the outcome, e.g. a capacity error); else at the first moment one of the
        planner's time-driven inputs crosses its configured threshold (a capacity error's TTL,
        spot_wait_s, the scaling cool-down, the interrupting window, a drain or boot timing out,
        the checkpoint age, the deadline guard), and at the latest after ``tick_s``."""
        now = world.now
        times = [now + (cfg.fleet.reconcile_interval_s if acted else self.tick_s)]
        if soon is not None:
            times.append(now + soon)  # the planner waits out a wave of notices (as the loop does)
        times += self._threshold_times(world, cfg)
        t = min(x for x in times if x > now)
        if self._tick is not None:
            self._tick.cancel()
        self._tick = world.queue.at(t, lambda: self._pass(world))

    def _threshold_times(self, world: World, cfg: FleetdConfig) -> list[float]:
        eps = 1e-3
        out = []
        cap = cfg.capacity
        if self.capacity_error_until is not None:
            out.append(self.capacity_error_until + eps)
        if self.spot_unavailable_since is not None:
            out.append(self.spot_unavailable_since + cap.spot_wait_s + eps)
        if self.last_scaling_at is not None:
            out.append(self.last_scaling_at + cfg.scaling.cooldown_s + eps)
        if self.last_notice_at is not None:
            out.append(self.last_notice_at + cap.interrupting_window_s + eps)
        if self.last_durable_at is not None:
            out.append(self.last_durable_at + cfg.rebalance.max_checkpoint_age_s + eps)
            if cfg.rebalance.young_daly_checkpoints:
                every = cadence((self._pool_stats(world),), len(world.members()), cfg.rebalance.checkpoint_stall_s)
                out.append(self.last_durable_at + every.interval_s + eps)
        for node_id, started in self.drain_started.items():
            node = world.held.get(node_id)
            if node is not None:
                out.append(started + cfg.rebalance.drain_timeout_s + eps)
                if node.notice_deadline is not None:
                    out.append(node.notice_deadline + eps)
        for node_id, phase in self.phase.items():
            if phase is NodePhase.PENDING and node_id in world.held:
                out.append(world.held[node_id].acquired_at + cap.boot_timeout_s + eps)
        if self.guard is not None:
            out.extend(self.guard.wake_times(world))
        return out

    # What a node's agent reports (the MQTT intake's part of the daemon's Node).
    TELEMETRY_FIELDS = (
        "last_seen_at", "notice_at", "notice_deadline", "gpu_util_pct", "steps_per_s", "step", "running_since",
        "left_at",
    )

    def _node_view(self, world: World, n: SimNode, per_node_rate: float | None, step: int) -> Node:
        phase = self.phase.get(n.id, NodePhase.RUNNING)
        training = phase is NodePhase.RUNNING and n.member
        on_demand = n.market == ON_DEMAND
        return Node(
            instance_id=n.id,
            pool=self.node_pool.get(n.id, self.od_pool if on_demand else self.pool),
            market=Market.ON_DEMAND if on_demand else Market.SPOT,
            price_per_hour=n.price_per_hour,
            launched_at=n.acquired_at,
            phase=phase,
            drain_started_at=self.drain_started.get(n.id),
            last_seen_at=None if phase is NodePhase.PENDING else world.now,
            notice_at=n.notice_at,
            notice_deadline=n.notice_deadline,
            gpu_util_pct=95.0 if training else None,
            steps_per_s=per_node_rate if training else None,
            step=step if training else None,
            running_since=self.running_since.get(n.id),
            left_at=self.left_at.get(n.id),
        )

    def telemetry(self, world: World, node: SimNode) -> dict:
        """What the simulated agent of ``node`` reports (for a daemon-side observer)."""
        w = len(world.members())
        view = self._node_view(world, node, world.job.throughput(w) / w if w else None, int(world.progress))
        return {f: getattr(view, f) for f in self.TELEMETRY_FIELDS}

    def signals(self) -> dict:
        """What the training/checkpoint side reports (SignalSource in the daemon)."""
        return {
            "throughput_by_nodes": MappingProxyType(dict(self.throughput)),
            "last_durable_checkpoint_step": self.last_durable_step,
            "last_durable_checkpoint_at": self.last_durable_at,
            "last_checkpoint_request_at": self.last_request_at,
        }

    def _pool_stats(self, world: World) -> PoolStats:
        """The spot pool's history as the ledger keeps it (spot node-hours, notices, losses)."""
        live_node_s = sum(world.now - n.acquired_at for n in world.held.values() if n.market != ON_DEMAND)
        return PoolStats(
            pool=self.pool,
            node_hours=(self.node_s_closed + live_node_s) / 3600.0,
            notices=self.notices,
            losses=self.losses,
            capacity_error_until=self.capacity_error_until,
            last_notice_at=self.last_notice_at,
            prior_interruptions_per_hour=self.prior,
        )

    def _observe(self, world: World, hide_spot: bool = False) -> Observation:
        members = world.members()
        if members:
            self.throughput[len(members)] = world.job.throughput(len(members))
        w = len(members)
        rate = world.job.throughput(w) / w if w else None
        step = int(world.progress)
        nodes = [self._node_view(world, n, rate, step) for n in world.held.values()]
        stats = self._pool_stats(world)
        offers = (
            PoolOffer(
                pool=self.pool,
                gpus=self.gpus,
                spot_price=None if hide_spot else world.spot_price,
                on_demand_price=world.on_demand_price,
            ),
            PoolOffer(
                pool=self.od_pool, gpus=self.gpus, spot_price=None, on_demand_price=world.on_demand_price
            ),
        )
        kwargs = {}
        if self.budget_level is not None:
            kwargs["budget_level"] = self.budget_level
        return Observation(
            nodes=tuple(nodes),
            offers=offers,
            pool_stats=(stats,),
            spent_usd=world.spent_usd(),
            **self.signals(),
            target_nodes=self.target,
            last_scaling_at=self.last_scaling_at,
            spot_unavailable_since=self.spot_unavailable_since,
            stop_issued_at=self.stop_issued_at,
            **kwargs,
        )

    # --- carrying out actions ------------------------------------------------------------
    def _execute(self, world: World, action) -> None:
        if isinstance(action, Launch):
            self._launch(world, action)
        elif isinstance(action, Drain):
            self._drain(world, action.instance_id)
        elif isinstance(action, Terminate):
            self._terminate(world, action.instance_id)
        elif isinstance(action, RequestCheckpoint):
            self._checkpoint(world)
            self.last_request_at = world.now
        elif isinstance(action, StopJob):
            self._checkpoint(world)
            self.stop_issued_at = world.now
            world.set_members([])
            for node_id in self.phase:
                self.phase[node_id] = NodePhase.LEAVING
        elif isinstance(action, MarkPoolUnavailable):
            self.capacity_error_until = action.until
        # Warn: logged through the record only.

    def _checkpoint(self, world: World) -> None:
        world.checkpoint()
        self.last_durable_at = world.now
        self.last_durable_step = int(world.progress)

    def _launch(self, world: World, action: Launch) -> None:
        if action.market is Market.SPOT:
            got = world.acquire_spot(action.count)
            if got:
                self.spot_unavailable_since = None
            if len(got) < action.count:
                # CreateFleet's partial fulfilment carries a capacity error for the pool.
                self.capacity_error_until = world.now + self.cfg.capacity.capacity_error_ttl_s
                if not got and self.spot_unavailable_since is None:
                    self.spot_unavailable_since = world.now
        else:
            got = world.acquire_on_demand(action.count)
        if not got:
            return
        world.log(f"launch {len(got)} {action.market.value}")
        for n in got:
            self.phase[n.id] = NodePhase.PENDING
            if action.pools:
                self.node_pool[n.id] = action.pools[0]
        if self.startup_s <= 0:
            self._admit(world, got)
        else:
            world.after(self.startup_s, lambda: self._admit_later(world, got))

    def _admit_later(self, world: World, nodes: list[SimNode]) -> None:
        alive = [n for n in nodes if world.held.get(n.id) is n and self.phase.get(n.id) is NodePhase.PENDING]
        if alive:
            self._admit(world, alive)
            self._pass(world)

    def _admit(self, world: World, nodes: list[SimNode]) -> None:
        """New nodes join at the next round (with the pass's other changes, if in a pass)."""
        for n in nodes:
            self.phase[n.id] = NodePhase.RUNNING
            self.running_since[n.id] = world.now
        if self._joining is not None:
            self._joining.extend(nodes)
        else:
            self._membership_round(world, nodes, [])

    def _drain(self, world: World, node_id: str) -> None:
        node = world.held.get(node_id)
        if node is None or self.phase.get(node_id) is not NodePhase.RUNNING:
            return
        # The daemon marks the node DRAINING; it stays billed (idle, out of the rendezvous) until
        # it reports that it left, AWS reclaims it, or the planner's drain timeout ends it.
        self.phase[node_id] = NodePhase.DRAINING
        self.drain_started[node_id] = world.now
        if self._joining is not None:
            self._leaving.append(node)
        else:
            self._membership_round(world, [], [node])

    def _membership_round(self, world: World, joining: list[SimNode], leaving: list[SimNode]) -> None:
        """One rendezvous round for every join and leave decided together: a coordinated
        checkpoint first (a leaver's shard, and the state a newcomer restores), so the re-form
        loses no steps; then every rank waits ``reform_s``."""
        joining = [n for n in joining if world.held.get(n.id) is n]
        leaving = [n for n in leaving if world.held.get(n.id) is n]
        if not joining and not leaving:
            return
        before = world.members()
        if before:
            self._checkpoint(world)
        gone = {n.id for n in leaving}
        world.set_members([n for n in before if n.id not in gone] + joining)
        world.stall(self.reform_s, "re-form", after_current=True)
        if self.leaving_signal:
            delay = self._left_delay_s(world, len(before))
            for node in leaving:
                world.after(delay, lambda n=node: self._left(world, n))

    def _left_delay_s(self, world: World, world_size: int) -> float:
        """Drain to trainer-exited: its checkpoint stall, its shard's upload, the leave."""
        shard_gb = world.job.checkpoint_gb / max(1, world_size)
        return world.job.checkpoint_stall_s + shard_gb / self.upload_gb_per_s + self.reform_s

    def _left(self, world: World, node: SimNode) -> None:
        """The agent reports its trainer exited after the drain (TrainerExited): the registry
        records left_at, and the planner terminates the node on the pass it wakes."""
        if world.held.get(node.id) is node and self.phase.get(node.id) is NodePhase.DRAINING:
            self.left_at[node.id] = world.now
            self._wake_now(world)

    def _terminate(self, world: World, node_id: str) -> None:
        node = world.held.get(node_id)
        if node is None:
            return
        was_member = node.member
        if node.market != ON_DEMAND:
            self.node_s_closed += world.now - node.acquired_at
        self._forget(node_id)
        world.release(node)
        if was_member:  # terminated while training: to the survivors, a loss without notice
            self._member_lost(world)

    def _forget(self, node_id: str) -> NodePhase | None:
        """The node is gone: drop what was kept about it (returns its last phase)."""
        self.drain_started.pop(node_id, None)
        self.left_at.pop(node_id, None)
        self.running_since.pop(node_id, None)
        self.node_pool.pop(node_id, None)
        return self.phase.pop(node_id, None)
