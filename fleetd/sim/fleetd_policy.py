"""fleetd's own policy in the simulator: the daemon's planner, `fleetd.policy.planner.plan`,
driven with a virtual clock.

It builds the `Observation` the reconcile loop would build, calls ``plan(obs, cfg, now)`` and
carries out each action as fleetd's components do: a short spot launch is a capacity error; the
joins and leaves of one pass are one round (one checkpoint, one re-form); a silent loss hangs the
collective until the steering pokes the survivors. Passes run on the events that wake the daemon
and at least every ``tick_s`` (docs/DESIGN.md "One interruption, end to end").
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from fleetd.config import FleetdConfig
from fleetd.policy import budget as budget_policy
from fleetd.policy.checkpointing import cadence
from fleetd.policy.memory import PlannerMemory, kept_memory
from fleetd.policy.model import LaunchPurpose, NodePhase, Plan, PoolId
from fleetd.policy.observation import Observation
from fleetd.policy.placement import NOTICE_LEAD_S
from fleetd.policy.planner import plan
from fleetd.sim import defaults as d
from fleetd.sim.books import SimNode
from fleetd.sim.clock import Timer
from fleetd.sim.engine import INSTANT, World
from fleetd.sim.fleetd_actions import ActionRecord, ActionsMixin, describe
from fleetd.sim.fleetd_observe import ObserveMixin

__all__ = ["ActionRecord", "FleetdPolicy", "Planner", "describe"]

Planner = Callable[[Observation, FleetdConfig, float], Plan]


class FleetdPolicy(ObserveMixin, ActionsMixin):
    name = "fleetd"

    def __init__(
        self,
        cfg: FleetdConfig,
        pool: PoolId,
        gpus_per_node: int = 1,
        reform_s: float = d.FLEETD_REFORM_S.value,
        # A join's round (None: ``reform_s``); see `ActionsMixin._round_s`.
        join_reform_s: float | None = None,
        detect_s: float = d.FLEETD_LOSS_DETECT_S.value,
        silent_loss_hang_s: float = d.FLEETD_SILENT_LOSS_HANG_S.value,
        # Survivors of a silent loss save the step they completed and lose only this; None (sharded
        # state): the job resumes from the last checkpoint.
        salvage_loss_s: float | None = d.SALVAGE_STEP_LOSS_S.value,
        prior_interruptions_per_hour: float | None = None,
        tick_s: float | None = None,
        startup_s: float = 0.0,
        # False: an agent that never says its trainer exited; the node is billed until reclaimed or
        # its drain times out.
        leaving_signal: bool = True,
        progress_survives_loss: bool = False,
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
        self._deadline_wake: tuple[float, ...] = ()  # the last plan's deadline wake-ups
        # DESIGN.md step 4: the drained node's agent reports that its trainer exited (the
        # registry's left_at); the planner terminates it at once. False: an agent that never
        # reports it (billed until AWS reclaims the node or the drain times out).
        self.leaving_signal = leaving_signal
        # Deadline jobs in Can't Be Late's model (every policy alike): a checkpoint is free and
        # progress survives a loss, so a noticed node trains until it is reclaimed.
        self.progress_survives_loss = progress_survives_loss
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
        self.join_reform_s = reform_s if join_reform_s is None else join_reform_s
        self.detect_s = detect_s
        self.silent_loss_hang_s = silent_loss_hang_s
        self.salvage_loss_s = salvage_loss_s
        self._hung_since: float | None = None  # a member lost at this instant: survivors hang
        self._hung_world = 0
        self.prior = prior_interruptions_per_hour
        self.tick_s = tick_s or d.SIM_PASS_INTERVAL_S.value
        self.phase: dict[str, NodePhase] = {}
        self.node_pool: dict[str, PoolId] = {}  # the launch's first pool, as EC2 fills it first
        self.node_purpose: dict[str, LaunchPurpose] = {}  # why each node was bought
        self.running_since: dict[str, float] = {}
        self.drain_started: dict[str, float] = {}
        self.memory = PlannerMemory()  # what the planner keeps between passes (fleetd/policy/memory.py)
        self.capacity_error_until: float | None = None
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
        """The world's capacity retry (or, with the oracle signal, capacity appearing).

        Probe (default): the daemon cannot see spot capacity appear; its planner tries the pool
        again once the capacity error's TTL ends (`_threshold_times`), which is the world's retry
        interval too (`Scenario` sets both from ``capacity.capacity_error_ttl_s``), so the retry
        adds nothing. Instant (the sensitivity setting the baselines get too): told at once,
        the capacity error is forgotten and a pass runs now."""
        if world.capacity_signal == INSTANT:
            self.capacity_error_until = None
            self._wake_now(world)

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
        world.stall(self.silent_loss_hang_s, "loss recovery", detail="hang until the survivors are poked")
        if world.members() and self.salvage_loss_s is not None:
            world.salvage(self._hung_world, self.salvage_loss_s)
            self.last_durable_at, self.last_durable_step = world.now, int(world.progress)
        else:
            world.rollback(detail="back to the last checkpoint after a silent loss")
        world.stall(self.reform_s, "loss recovery", after_current=True, detail="re-form")

    # --- one reconcile pass --------------------------------------------------------------
    def _pass(self, world: World) -> None:
        if self._wake is not None and self._wake_at == world.now:
            self._wake.cancel()  # this pass is the one it was due for
        self._wake = None
        if world.done:
            return
        now = world.now
        cfg = self.cfg
        obs = self._observe(world)
        result: Plan = self.planner(obs, cfg, now)
        self.passes += 1
        self.pass_times.append(now)
        self.memory = kept_memory(result)  # what the plan leaves, kept as the reconcile loop keeps it
        self._deadline_wake = result.deadline.wake_at if result.deadline is not None else ()
        self._joining, self._leaving = [], []
        try:
            for action in result.actions:
                kind, detail = describe(action)
                self.record.append(ActionRecord(now, kind, detail))
                self._execute(world, action)
        finally:
            joining, leaving = self._joining, self._leaving
            self._joining, self._leaving = None, []
        if joining:
            world.queue.at(now, functools.partial(self._round_after_notices, world, joining, leaving))
        else:
            self._membership_round(world, joining, leaving)
        self._schedule_next(world, cfg, acted=bool(result.actions), soon=result.replan_in_s)

    def _round_after_notices(self, world: World, joining: list[SimNode], leaving: list[SimNode]) -> None:
        """The pass's round when it launched nodes: at the same instant, after that instant's
        notices (queued at the POLICY priority), so a node bought inside its notice window is
        known to be noticed before it would join (`_ready`)."""
        self._membership_round(world, self._ready(world, joining), leaving)

    def _schedule_next(self, world: World, cfg: FleetdConfig, acted: bool, soon: float | None = None) -> None:
        """The next pass: one reconcile interval after a pass that acted (the daemon's cadence,
        so it sees the outcome, e.g. a capacity error); else at the first moment one of the
        planner's time-driven inputs crosses its configured threshold (a capacity error's TTL,
        spot_wait_s, the scaling cool-down, the interrupting window, a drain or boot timing out,
        the checkpoint age, the deadline rule's crossings), and at the latest after ``tick_s``."""
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
            # When the pool may be tried again before an on-demand purchase (buying.spot_probe_pools).
            probe_after = min(cap.spot_probe_s, cap.capacity_error_ttl_s)
            out.append(self.capacity_error_until - cap.capacity_error_ttl_s + probe_after + eps)
        if self.memory.spot_unavailable_since is not None:
            out.append(self.memory.spot_unavailable_since + cap.spot_wait_s + eps)
        if self.memory.last_scaling_at is not None:
            out.append(self.memory.last_scaling_at + cfg.scaling.cooldown_s + eps)
        if self.last_notice_at is not None:
            out.append(self.last_notice_at + cap.interrupting_window_s + eps)
            out.append(self.last_notice_at + NOTICE_LEAD_S + eps)  # the reclaim wave is over
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
        out.extend(self._deadline_wake)
        cross = self._budget_cross_time(world, cfg)
        if cross is not None:
            out.append(cross + eps)
        return out

    @staticmethod
    def _budget_cross_time(world: World, cfg: FleetdConfig) -> float | None:
        """When the spend committed at a pass (spent + every held node over the commit window,
        fleetd/policy/budget.py) reaches budget.total_usd at today's burn. The daemon passes every
        reconcile interval, well inside the window; the simulator's idle passes are sparser
        (tick_s), so without this wake-up the stop came one idle pass late, past the cap."""
        burn = sum(n.price_per_hour for n in world.held.values())
        if burn <= 0:
            return None
        window_usd = burn * budget_policy.commit_window_s(cfg) / 3600.0
        left = cfg.budget.total_usd - world.spent_usd() - window_usd
        # Already past it: this pass saw it (and stopped); no wake-up loop while nodes leave.
        return world.now + left * 3600.0 / burn if left > 0 else None
