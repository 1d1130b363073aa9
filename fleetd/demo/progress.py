"""Training progress facts from the trainers' JSON-lines event trace (``FLEETD_EVENTS_FILE``).

Every rank appends ``step`` (each completed step) and ``start`` (after resuming, with
``from_step``) records. From them:
- steps lost at a membership change = last step completed before the re-start − step resumed from;
- resume latency = change → every rank of the new world has completed a step at the new size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Restart:
    at: float  # first 'start' record of the new world
    world: int
    from_step: int
    last_step_before: int
    trained_until: int | None = None  # the furthest step this attempt completed
    next_from: int | None = None  # the step the next attempt resumed from (None: the last one)

    @property
    def steps_lost(self) -> int:
        lost = max(0, self.last_step_before - self.from_step)
        if self.next_from is not None and self.next_from >= self.last_step_before:
            # A stale world (a node that restored an older copy) was itself replaced by one that
            # resumed at or past the high-water mark: only the steps it trained again were lost.
            lost = min(lost, max(0, (self.trained_until or self.from_step) - self.from_step))
        return lost


@dataclass(frozen=True)
class Progress:
    records: tuple[dict[str, Any], ...]

    @classmethod
    def load(cls, path: Path) -> Progress:
        recs = []
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut by a SIGKILLed writer
                if isinstance(rec, dict) and "ev" in rec and "t" in rec:
                    recs.append(rec)
        recs.sort(key=lambda r: r["t"])
        return cls(tuple(recs))

    @property
    def final_step(self) -> int:
        return max((r["step"] for r in self.records if r["ev"] == "step"), default=0)

    @property
    def max_world_size(self) -> int:
        return max((r.get("world", 0) for r in self.records if r["ev"] == "step"), default=0)

    def restarts(self) -> list[Restart]:
        """One entry per re-formed world after the first (grouping 'start' records by world size
        changes in time order)."""
        out: list[Restart] = []
        last_step, world = 0, None  # the furthest step of the current attempt
        for r in self.records:
            if r["ev"] == "step":
                last_step = max(last_step, r["step"])
                world = r.get("world", world)
            elif r["ev"] == "start" and world is not None and (not out or r["t"] - out[-1].at > 2.0):
                if out:
                    out[-1] = replace(out[-1], trained_until=last_step, next_from=int(r.get("from_step", 0)))
                out.append(Restart(r["t"], r.get("world", 0), int(r.get("from_step", 0)), last_step))
                # The new attempt starts from its checkpoint: steps redone after a rollback must
                # not be counted as lost a second time at the next change.
                last_step = int(r.get("from_step", 0))
        if out:
            out[-1] = replace(out[-1], trained_until=last_step)
        return out

    def training_again_at(self, after: float, world: int | None = None) -> float | None:
        """Earliest time after ``after`` by which every rank of a world has completed a step at
        that world size (the first such world if ``world`` is None)."""
        seen: dict[int, dict[int, float]] = {}
        for r in self.records:
            if r["ev"] != "step" or r["t"] <= after:
                continue
            w = r.get("world", 0)
            if world is not None and w != world:
                continue
            ranks = seen.setdefault(w, {})
            ranks.setdefault(r.get("rank", 0), r["t"])
            if len(ranks) >= w > 0:
                return max(ranks.values())
        return None
