"""Goodput from the trainers' real progress: ledger events folded from what the nodes report.

Each pass ``GoodputTracker.observe`` takes the nodes as the planner sees them and returns the
ledger events the pass adds: ``StepReached`` (a new highest step), ``StepsLost`` (a resume below
it), ``StepsRegained`` (a jump back over steps counted lost), ``RecoveryTime`` (progress again after
a stall) and ``IdleGpuTime`` per billed node. Pure; the daemon seeds it from the ledger after a
restart (``resume``), so useful steps never count twice (docs/DESIGN.md "Budget semantics").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from fleetd.policy.ledger_events import (
    IdleGpuTime,
    LedgerEvent,
    RecoveryTime,
    StepReached,
    StepsLost,
    StepsRegained,
)
from fleetd.policy.model import Node

LIVE = ("pending", "running")


@dataclass
class GoodputTracker:
    fresh_s: float = 30.0  # a node's step older than this no longer describes the job
    stall_after_s: float = 10.0
    idle_util_pct: float = 10.0
    skew_s: float = 5.0  # report periods of skew tolerated before a drop counts as lost steps
    highest: int = 0
    current: int | None = None  # the job's step at the last pass that saw one
    last_progress_at: float | None = None
    last_pass_at: float | None = None
    # Steps counted in StepsLost between ``current`` and ``highest`` that a jump may still bring
    # back; steps trained again up to ``highest`` confirm their loss.
    unconfirmed_loss: int = 0
    _node_step: dict[str, int] = field(default_factory=dict)

    def resume(self, events: Iterable[LedgerEvent]) -> None:
        """Seed from the persisted ledger (after a restart): the highest step already counted."""
        for e in events:
            if isinstance(e, StepReached):
                self.highest = max(self.highest, e.step)
        self.current = self.highest if self.highest else None

    def observe(self, nodes: Sequence[Node], now: float, gpus_of: Mapping[str, int] | None = None) -> list[LedgerEvent]:
        gpus_of = gpus_of or {}
        events: list[LedgerEvent] = []
        live = [n for n in nodes if n.ec2_state in LIVE]
        fresh = [
            n
            for n in live
            if n.step is not None and n.last_seen_at is not None and now - n.last_seen_at <= self.fresh_s
        ]
        step = max(
            (n.step for n in fresh if n.step is not None), default=None
        )  # synchronous job: every rank is within a step
        rate = max((n.steps_per_s or 0.0 for n in fresh), default=0.0)
        progressed = False
        if step is not None:
            # Nodes report about once a second and not in lockstep: a drop within ``slack`` steps is
            # reporting skew, not a loss.
            slack = math.ceil(rate * self.skew_s)
            if self.current is not None and step < self.current - slack:
                events.append(
                    StepsLost(
                        at=now, from_step=self.current, to_step=step, event_id=f"lost:{self.current}:{step}:{now:.3f}"
                    )
                )
                self.unconfirmed_loss = min(self.unconfirmed_loss + self.current - step, self.highest - step)
            elif self.current is not None and step > self.current and self.unconfirmed_loss:
                events += self._regained(step, rate, slack, now)
            progressed = self.current is None or step > self.current
            if step > self.highest:
                self.highest = step
                events.append(StepReached(at=now, step=step, event_id=f"step:{step}"))
            self.current = step
        if progressed:
            if self.last_progress_at is not None and now - self.last_progress_at > self.stall_after_s:
                events.append(RecoveryTime(at=now, seconds=now - self.last_progress_at, event_id=f"recovery:{now:.3f}"))
            self.last_progress_at = now
        elif self.last_progress_at is None and live:
            self.last_progress_at = now  # the first billed pass: a stall is measured from here
        events += self._idle(live, now, gpus_of)
        self.last_pass_at = now
        return events

    def _regained(self, step: int, rate: float, slack: int, now: float) -> list[LedgerEvent]:
        """The job rose from ``current`` to ``step``: by a jump (a newer copy resumed) the steps
        jumped over below ``highest`` come back; by training they are confirmed lost."""
        assert self.current is not None
        out: list[LedgerEvent] = []
        elapsed = now - self.last_pass_at if self.last_pass_at is not None else math.inf
        # A rise that training could explain keeps the loss: when unsure, the report says more was
        # lost, never less.
        if step - self.current > rate * elapsed + slack:
            back = min(self.unconfirmed_loss, min(step, self.highest) - self.current)
            if back > 0:
                out.append(StepsRegained(at=now, steps=back, event_id=f"regained:{self.current}:{step}:{now:.3f}"))
                self.unconfirmed_loss -= back
        self.unconfirmed_loss = max(0, min(self.unconfirmed_loss, self.highest - step))
        return out

    def _idle(self, live: Sequence[Node], now: float, gpus_of: Mapping[str, int]) -> list[LedgerEvent]:
        out: list[LedgerEvent] = []
        since = self.last_pass_at
        steps = {}
        for n in live:
            previous = self._node_step.get(n.instance_id)
            if n.step is not None:
                steps[n.instance_id] = n.step
            if since is None or now <= since:
                continue
            span = now - max(since, n.launched_at)
            if span <= 0:
                continue
            if n.gpu_util_pct is not None:
                idle = n.gpu_util_pct < self.idle_util_pct
            else:
                # No GPU telemetry: idle when its trainer made no progress this pass (booting, waiting for
                # a round, draining).
                idle = n.step is None or previous is None or n.step <= previous
            if idle:
                gpus = max(1, gpus_of.get(n.pool.instance_type, 0))
                out.append(
                    IdleGpuTime(
                        at=now,
                        instance_id=n.instance_id,
                        gpu_seconds=span * gpus,
                        event_id=f"idle:{n.instance_id}:{now:.3f}",
                    )
                )
        self._node_step = steps
        return out
