"""The job's books in the simulated world: membership, stalls, checkpoints, rollbacks, and the
integration of progress and node-time between events (engine.py's accounting rules).

A mixin of `fleetd.sim.engine.World` (split from it: one job per module); the state it works on is
set up in `World.__init__`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetd.sim.job import JobSpec


@dataclass(eq=False, slots=True)
class SimNode:
    id: str
    market: str
    price_per_hour: float
    acquired_at: float
    pool: str
    member: bool = False  # in the training world
    notice_at: float | None = None
    notice_deadline: float | None = None
    released_at: float | None = None
    lost: bool = False


def overhead_label(reason: str, detail: str = "") -> str:
    """A line of the overhead breakdown: the reason, and its cause when one was given (e.g.
    ``re-form: join``); ``overhead`` sums the reasons, ``breakdown`` keeps the labels."""
    return f"{reason}: {detail}" if detail else reason


class TrainingBooks:
    # The state this mixin works on, set up in `World.__init__` (declarations only).
    job: JobSpec
    held: dict[str, SimNode]
    progress: float
    checkpoint_progress: float
    steps_lost: float
    stalled_until: float
    stall_reason: str
    _stalls: list[tuple[float, float, str, str]]
    _uncommitted_node_s: float
    useful_node_s: float
    overhead: dict[str, float]
    breakdown: dict[str, float]
    done_at: float | None
    _last: float
    _members: int

    if TYPE_CHECKING:

        @property
        def now(self) -> float: ...

    def members(self) -> list[SimNode]:
        return [n for n in self.held.values() if n.member]

    def set_members(self, nodes: list[SimNode]) -> None:
        self.advance()
        wanted = {n.id for n in nodes}
        for n in self.held.values():
            n.member = n.id in wanted
        self._members = len(wanted)

    def stall(self, seconds: float, reason: str, after_current: bool = False, detail: str = "") -> None:
        """Every member stops training for ``seconds``: from now, overlapping any stall under
        way, or (``after_current``) once the stall under way is over (one thing after another,
        e.g. a re-form after the checkpoint that precedes it). ``detail`` names its cause within
        ``reason`` in the breakdown (``overhead_label``)."""
        self.advance()
        if seconds <= 0:
            return
        begin = max(self.now, self.stalled_until)
        end = (begin if after_current else self.now) + seconds
        if end > begin:
            self._stalls.append((begin, end, reason, detail))
            self.stalled_until = end
            self.stall_reason = reason

    @property
    def training(self) -> bool:
        return self._members > 0 and self.now >= self.stalled_until and self.done_at is None

    def checkpoint(self, stall_s: float | None = None, detail: str = "") -> bool:
        """Save a checkpoint of the current progress (paying the stall). False if nothing new."""
        self.advance()
        if self.progress <= self.checkpoint_progress:
            return False
        self.checkpoint_progress = self.progress
        self.useful_node_s += self._uncommitted_node_s
        self._uncommitted_node_s = 0.0
        self.stall(self.job.checkpoint_stall_s if stall_s is None else stall_s, "checkpoint", detail=detail)
        return True

    def rollback(self, detail: str = "") -> None:
        """Resume from the last checkpoint: the work since then is lost."""
        self.advance()
        self.steps_lost += self.progress - self.checkpoint_progress
        self._add_overhead("lost work", self._uncommitted_node_s, detail)
        self._uncommitted_node_s = 0.0
        self.progress = self.checkpoint_progress

    def salvage(self, world_size: int, lost_s: float) -> None:
        """The survivors of a loss save the step they completed (after the stall under way): the
        step in flight, ``lost_s`` of ``world_size`` ranks' work, is lost; the rest is kept."""
        self.advance()
        uncommitted = self.progress - self.checkpoint_progress
        lost = min(uncommitted, self.job.throughput(world_size) * lost_s)
        share = lost / uncommitted if uncommitted > 0 else 0.0
        self.steps_lost += lost
        self.progress -= lost
        self._add_overhead("lost work", share * self._uncommitted_node_s, "step in flight")
        self.useful_node_s += (1.0 - share) * self._uncommitted_node_s
        self._uncommitted_node_s = 0.0
        self.checkpoint_progress = self.progress
        self.stall(self.job.checkpoint_stall_s, "checkpoint", after_current=True, detail="salvage after a silent loss")

    @property
    def remaining_steps(self) -> float:
        return max(0.0, self.job.total_steps - self.progress)

    @property
    def done(self) -> bool:
        return self.done_at is not None

    def _add_overhead(self, reason: str, node_s: float, detail: str = "") -> None:
        if node_s > 0:
            self.overhead[reason] = self.overhead.get(reason, 0.0) + node_s
            label = overhead_label(reason, detail)
            self.breakdown[label] = self.breakdown.get(label, 0.0) + node_s

    def advance(self) -> None:
        """Integrate progress and node-time from the last call to now."""
        now = self.now
        dt = now - self._last
        if dt <= 0:
            return
        w = self._members
        idle = len(self.held) - w
        if idle:
            self._add_overhead("idle (held, not training)", idle * dt)
        if w and self.done_at is None:
            stalled = 0.0
            while self._stalls:
                begin, end, reason, detail = self._stalls[0]
                part = max(0.0, min(now, end) - max(self._last, begin))
                if part:
                    stalled += part
                    self._add_overhead(reason, w * part, detail)
                if end > now:
                    break
                self._stalls.pop(0)
            active = dt - stalled
            if active > 1e-12:
                self.progress += self.job.throughput(w) * active
                self._uncommitted_node_s += w * active
        else:
            while self._stalls and self._stalls[0][1] <= now:
                self._stalls.pop(0)
        self._last = now
