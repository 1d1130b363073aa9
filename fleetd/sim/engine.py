"""Discrete-event simulation of one training job on a spot trace.

A virtual clock and a heap of events: the `World` replays a `Trace`, bills each node as the
daemon's ledger does (``fleetd.policy.ledger.charge``) and integrates progress; a `Policy` reacts
to its callbacks by buying and releasing nodes, re-forming, checkpointing, rolling back. Capacity
is found by trying, as on EC2: a short spot attempt calls ``on_capacity`` again
``capacity_retry_s`` later (docs/DESIGN.md "Placement and deadlines"). Accounting, in
node-seconds: paid = useful + lost work + stalls by reason + idle; effective = useful / paid.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable
from typing import Protocol

from fleetd.policy.ledger import charge
from fleetd.sim.books import SimNode, TrainingBooks
from fleetd.sim.clock import NOTICE, POLICY, TRACE, EventQueue, Timer
from fleetd.sim.defaults import CAPACITY_RETRY_S
from fleetd.sim.job import JobSpec
from fleetd.sim.result import Sample, SimResult
from fleetd.sim.traces import ADD, Trace

SPOT = "spot"
ON_DEMAND = "on-demand"
PROBE = "probe"  # capacity is found by trying; a short attempt is retried (module docstring)
INSTANT = "instant"  # the oracle: on_capacity the instant the trace adds capacity
CAPACITY_SIGNALS = (PROBE, INSTANT)


class Policy(Protocol):
    name: str

    def start(self, world: World) -> None: ...
    def on_capacity(self, world: World) -> None: ...
    def on_notice(self, world: World, node: SimNode) -> None: ...
    def on_lost(self, world: World, node: SimNode, noticed: bool) -> None: ...


class World(TrainingBooks):
    """The simulated cloud and job. Policies act on it; it keeps the books."""

    def __init__(
        self,
        trace: Trace,
        job: JobSpec,
        spot_price: float,
        on_demand_price: float,
        seed: int = 0,
        horizon_s: float | None = None,
        sample_every_s: float = 0.0,
        capacity_retry_s: float = CAPACITY_RETRY_S.value,
        capacity_signal: str = PROBE,
    ) -> None:
        if capacity_signal not in CAPACITY_SIGNALS:
            raise ValueError(f"capacity_signal must be one of {CAPACITY_SIGNALS}, not {capacity_signal!r}")
        if capacity_retry_s <= 0:
            raise ValueError("capacity_retry_s must be > 0")
        self.capacity_retry_s = capacity_retry_s
        self.capacity_signal = capacity_signal
        self._retry: Timer | None = None  # the pending capacity retry (one at a time)
        self.capacity_retries = 0
        self.trace = trace
        self.job = job
        self.spot_price = spot_price
        self.on_demand_price = on_demand_price
        self.seed = seed
        self.horizon_s = trace.duration_s if horizon_s is None else horizon_s
        self.queue = EventQueue()
        self.free: dict[str, str] = {}  # trace node -> pool, available and not held
        self.held: dict[str, SimNode] = {}
        self._removal_at: dict[str, float] = {}  # trace node -> its next removal time
        self._pending_removals: dict[str, list[float]] = {}
        self._serial = itertools.count(1)
        # Job state.
        self.progress = 0.0
        self.checkpoint_progress = 0.0
        self.steps_lost = 0.0
        self.stalled_until = 0.0
        self.stall_reason = ""
        self._stalls: list[tuple[float, float, str, str]] = []  # queued (begin, end, reason, detail)
        self._uncommitted_node_s = 0.0
        self.useful_node_s = 0.0
        self.overhead: dict[str, float] = {}
        self.breakdown: dict[str, float] = {}  # the overhead by reason and cause (books.overhead_label)
        self.done_at: float | None = None
        self._last = 0.0
        self._members = 0
        # Billing of released nodes.
        self.spent_released = 0.0
        self.od_equivalent_released = 0.0  # the same billed seconds at the on-demand price
        self.paid_released_s = 0.0
        self.od_paid_released_s = 0.0
        self.notices = 0
        self.unannounced = 0
        self.actions: list[str] = []
        self._completion: Timer | None = None
        self._sample_every = sample_every_s
        self.timeline: list[Sample] = []
        self.policy: Policy | None = None  # set by run()

    # --- clock and timers ----------------------------------------------------------------
    @property
    def now(self) -> float:
        return self.queue.now

    def after(self, delay_s: float, fn: Callable[[], None]) -> Timer:
        return self.queue.at(self.now + max(0.0, delay_s), fn)

    def log(self, text: str) -> None:
        self.actions.append(f"{self.now:.0f}s {text}")

    # --- the market ----------------------------------------------------------------------
    def free_spot(self) -> int:
        """The trace's free capacity: a view for harnesses and tests, not for policies (no real
        tool sees it; a policy asks with ``spot_offered`` or ``acquire_spot``, which are tries)."""
        return len(self.free)

    def spot_offered(self) -> bool:
        """A launch attempt's answer, for a policy about to buy one spot node: is any offered?
        No counts as a short attempt (a retry is due), as ``acquire_spot`` coming back short."""
        if not self.free:
            self._short()
        return bool(self.free)

    def _short(self) -> None:
        """A spot attempt came back short: call ``on_capacity`` one retry interval later (unless
        a retry is already due: the policy then learns at the earlier one)."""
        if self.capacity_signal != PROBE or self._retry is not None:
            return
        self._retry = self.after(self.capacity_retry_s, self._capacity_retry)

    def _capacity_retry(self) -> None:
        self._retry = None
        self.capacity_retries += 1
        assert self.policy is not None  # set by run(), before any event
        self.policy.on_capacity(self)

    def acquire_spot(self, count: int) -> list[SimNode]:
        """Take up to ``count`` available spot nodes (all of them: the trace is the capacity).
        Fewer than asked is a capacity error: the policy's ``on_capacity`` runs one retry
        interval later (module docstring)."""
        if count > len(self.free):
            self._short()
        got: list[SimNode] = []
        for trace_node in list(self.free)[: max(0, count)]:
            pool = self.free.pop(trace_node)
            node = SimNode(trace_node, SPOT, self.spot_price, self.now, pool)
            self.held[node.id] = node
            got.append(node)
            removal = self._removal_at.get(trace_node)
            # Bought inside its notice window: AWS sends the notice right away.
            if (
                removal is not None
                and removal - self.job.notice_lead_s <= self.now
                and self._announced(trace_node, removal)
            ):
                self.queue.at(self.now, functools.partial(self._notice, node, removal), NOTICE)
        return got

    def acquire_on_demand(self, count: int) -> list[SimNode]:
        got = []
        for _ in range(max(0, count)):
            node = SimNode(f"od-{next(self._serial)}", ON_DEMAND, self.on_demand_price, self.now, "on-demand")
            self.held[node.id] = node
            got.append(node)
        return got

    def release(self, node: SimNode) -> None:
        """Stop paying for ``node`` (terminated by the policy, or reclaimed)."""
        if node.id not in self.held:
            return
        self.advance()
        if node.member:
            self.set_members([n for n in self.members() if n is not node])
        del self.held[node.id]
        node.released_at = self.now
        billed, usd = charge(node.acquired_at, self.now, node.price_per_hour)
        # The 60 s minimum beyond what was used is paid for nothing.
        self._add_overhead("minimum charge", billed - (self.now - node.acquired_at))
        self.spent_released += usd
        self.od_equivalent_released += charge(node.acquired_at, self.now, self.on_demand_price).usd
        self.paid_released_s += billed
        if node.market == ON_DEMAND:
            self.od_paid_released_s += billed

    def spent_usd(self) -> float:
        """Released nodes' bills plus what the held ones owe now, their 60 s minimum included
        (as the daemon's ledger bills a running instance: ``ledger.charge``)."""
        return self.spent_released + sum(
            charge(n.acquired_at, self.now, n.price_per_hour).usd for n in self.held.values()
        )

    # --- running -------------------------------------------------------------------------
    def _schedule_completion(self) -> None:
        if self._completion is not None:
            self._completion.cancel()
            self._completion = None
        if self.done_at is not None or self._members == 0:
            return
        rate = self.job.throughput(self._members)
        t = max(self.now, self.stalled_until) + self.remaining_steps / rate
        self._completion = self.queue.at(t, self._complete, TRACE)

    def _complete(self) -> None:
        self.advance()
        if self.remaining_steps > 1e-6 * self.job.total_steps:
            return  # a stale estimate; a fresh one is scheduled after this event
        self.progress = self.job.total_steps
        self.useful_node_s += self._uncommitted_node_s
        self._uncommitted_node_s = 0.0
        self.done_at = self.now
        for node in list(self.held.values()):
            self.release(node)
        self.log("job complete")

    def _notice(self, node: SimNode, removal_at: float) -> None:
        if self.held.get(node.id) is not node or node.notice_at is not None:
            return
        node.notice_at = self.now
        node.notice_deadline = removal_at
        self.notices += 1
        assert self.policy is not None  # set by run(), before any event
        self.policy.on_notice(self, node)

    def _announced(self, trace_node: str, t: float) -> bool:
        # Decided per (seed, node, time) so every policy sees the same unannounced losses.
        return random.Random(f"{self.seed}:{trace_node}:{t}").random() >= self.job.no_notice_share

    def _trace_event(self, kind: str, trace_node: str, pool: str) -> None:
        if kind == ADD:
            self.free[trace_node] = pool
            if self.capacity_signal == INSTANT:
                assert self.policy is not None  # set by run(), before any event
                self.policy.on_capacity(self)
            return
        self.free.pop(trace_node, None)
        later = self._pending_removals.get(trace_node, [])
        if later:
            later.pop(0)
        if later:
            self._removal_at[trace_node] = later[0]
        else:
            self._removal_at.pop(trace_node, None)
        node = self.held.get(trace_node)
        if node is None:
            return
        noticed = node.notice_at is not None
        if not noticed:
            self.unannounced += 1
        node.lost = True
        self.release(node)
        assert self.policy is not None  # set by run(), before any event
        self.policy.on_lost(self, node, noticed)

    def _sample(self) -> None:
        self.advance()
        self.timeline.append(Sample(self.now, len(self.held), self.spent_usd(), self.progress / self.job.total_steps))
        if self.done_at is None:
            self.queue.at(self.now + self._sample_every, self._sample, POLICY)

    def run(self, policy: Policy) -> SimResult:
        self.policy = policy
        lead = self.job.notice_lead_s
        for ev in self.trace.events:
            self.queue.at(ev.t, functools.partial(self._trace_event, ev.kind, ev.node, ev.pool), TRACE)
            if ev.kind != ADD:
                if self._announced(ev.node, ev.t):
                    self.queue.at(
                        max(0.0, ev.t - lead),
                        functools.partial(self._notice_trace, ev.node, ev.t),
                        NOTICE,
                    )
        # Removal times must be known before nodes are bought (for notices inside the window).
        for ev in self.trace.events:
            if ev.kind != ADD:
                self._pending_removals.setdefault(ev.node, []).append(ev.t)
        for trace_node, times in self._pending_removals.items():
            self._removal_at[trace_node] = times[0]
        self.queue.at(0.0, lambda: policy.start(self), POLICY)
        if self._sample_every > 0:
            self.queue.at(0.0, self._sample, POLICY)
        while self.done_at is None:
            fn = self.queue.pop_until(self.horizon_s)
            if fn is None:
                break
            self.advance()
            fn()
            self._schedule_completion()
        if self.done_at is None:
            self.queue.now = self.horizon_s
            self.advance()
            # Cut off by the end of the trace: the work in hand counts (the job goes on).
            self.useful_node_s += self._uncommitted_node_s
            self._uncommitted_node_s = 0.0
            for node in list(self.held.values()):
                self.release(node)
        if self._sample_every > 0:
            self.timeline.append(Sample(self.now, 0, self.spent_usd(), self.progress / self.job.total_steps))
        return self._result(policy.name)

    def _notice_trace(self, trace_node: str, removal_at: float) -> None:
        node = self.held.get(trace_node)
        if node is not None:
            self._notice(node, removal_at)

    def _result(self, name: str) -> SimResult:
        paid = self.paid_released_s
        deadline = self.job.deadline_s
        met = None
        if deadline is not None:
            met = self.done_at is not None and self.done_at <= deadline + 1e-6
        return SimResult(
            policy=name,
            trace=self.trace.name,
            cost_usd=self.spent_released,
            on_demand_cost_usd=self.od_equivalent_released,
            paid_node_s=paid,
            useful_node_s=self.useful_node_s,
            effective_time=self.useful_node_s / paid if paid > 0 else 0.0,
            steps_done=self.progress,
            steps_lost=self.steps_lost,
            total_steps=self.job.total_steps,
            completed=self.done_at is not None,
            finished_at_s=self.done_at,
            deadline_s=deadline,
            deadline_met=met,
            notices=self.notices,
            losses_without_notice=self.unannounced,
            overhead_node_s=dict(self.overhead),
            breakdown_node_s=dict(self.breakdown),
            on_demand_node_s=self.od_paid_released_s,
            actions=self.actions,
            timeline=self.timeline,
        )


def simulate(
    trace: Trace,
    policy: Policy,
    job: JobSpec,
    spot_price: float,
    on_demand_price: float,
    seed: int = 0,
    horizon_s: float | None = None,
    sample_every_s: float = 0.0,
    capacity_retry_s: float = CAPACITY_RETRY_S.value,
    capacity_signal: str = PROBE,
) -> SimResult:
    world = World(
        trace, job, spot_price, on_demand_price, seed, horizon_s, sample_every_s, capacity_retry_s, capacity_signal
    )
    return world.run(policy)
