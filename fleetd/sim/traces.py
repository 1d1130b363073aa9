"""Spot traces: when capacity appeared and when it was taken away.

Every reader returns the same `Trace`: a time-sorted list of ``add``/``remove`` events of named
nodes, in seconds from the trace start. Three sources:

- the Bamboo/Oobleck event CSV (``time_ms,add|remove,nodeNAME``, no header);
- a per-tick availability series, JSON ``{"metadata": {"gap_seconds": G}, "data": [...]}``.
  Public traces disagree on what a value means, so the caller says (`ValueMeaning`): 0/1
  availability, a node count, or "1 means preempted" (as in Can't Be Late's traces);
- a synthetic generator: Poisson interruptions per pool with correlated pool-wide losses.

The format of a file is detected from its content (JSON starts with ``{``), not its name.
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

ADD = "add"
REMOVE = "remove"


class TraceError(ValueError):
    """A trace file could not be read; the message names the file and the offending line."""


class ValueMeaning(StrEnum):
    AVAILABLE = "available"  # 1: a spot node can be had, 0: none (values must be 0/1)
    COUNT = "count"  # the number of spot nodes that can be had
    PREEMPTED = "preempted"  # 1 (truthy): no spot node, 0: one can be had


class TraceFormat(StrEnum):
    BAMBOO_CSV = "bamboo-csv"
    AVAILABILITY_JSON = "availability-json"


@dataclass(frozen=True, slots=True)
class TraceEvent:
    t: float  # seconds from the trace start
    kind: str  # ADD or REMOVE
    node: str
    pool: str = "trace"


@dataclass(frozen=True)
class Trace:
    """Node availability over ``[0, duration_s]``. Nodes live at t=0 appear as adds at t=0."""

    name: str
    events: tuple[TraceEvent, ...]
    duration_s: float
    source: str = ""
    _times: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _live: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        times: list[float] = []
        live: list[int] = []
        n = 0
        for ev in self.events:
            n += 1 if ev.kind == ADD else -1
            if times and times[-1] == ev.t:
                live[-1] = n
            else:
                times.append(ev.t)
                live.append(n)
        object.__setattr__(self, "_times", tuple(times))
        object.__setattr__(self, "_live", tuple(live))

    # --- questions the simulator and `fleetd plan` ask -------------------------------------
    def live_at(self, t: float) -> int:
        """Nodes available at time ``t`` (events at exactly ``t`` included)."""
        i = bisect.bisect_right(self._times, t) - 1
        return self._live[i] if i >= 0 else 0

    @property
    def max_live(self) -> int:
        return max(self._live, default=0)

    def node_seconds(self) -> float:
        """Integral of live nodes over the trace (the most node-time anyone could buy)."""
        total = 0.0
        for i, t in enumerate(self._times):
            end = self._times[i + 1] if i + 1 < len(self._times) else self.duration_s
            total += self._live[i] * max(0.0, end - t)
        return total

    def mean_live(self) -> float:
        return self.node_seconds() / self.duration_s if self.duration_s > 0 else 0.0

    def removals(self) -> int:
        return sum(1 for ev in self.events if ev.kind == REMOVE)

    def pools(self) -> tuple[str, ...]:
        return tuple(sorted({ev.pool for ev in self.events}))

    def window(self, start_s: float, length_s: float | None = None) -> Trace:
        """The trace seen by a job that starts at ``start_s``: nodes live then become adds at 0."""
        end = self.duration_s if length_s is None else min(self.duration_s, start_s + length_s)
        if not 0 <= start_s < self.duration_s:
            raise ValueError(f"start {start_s} s is outside the trace (0..{self.duration_s} s)")
        live: dict[str, TraceEvent] = {}
        out: list[TraceEvent] = []
        for ev in self.events:
            if ev.t > start_s:
                break
            if ev.kind == ADD:
                live[ev.node] = ev
            else:
                live.pop(ev.node, None)
        out.extend(TraceEvent(0.0, ADD, ev.node, ev.pool) for ev in live.values())
        for ev in self.events:
            if start_s < ev.t <= end:
                out.append(TraceEvent(ev.t - start_s, ev.kind, ev.node, ev.pool))
        return Trace(f"{self.name}@{start_s:.0f}s", tuple(out), end - start_s, self.source)


def _checked(events: list[TraceEvent], where: str) -> tuple[TraceEvent, ...]:
    """Sort stably by time and check that adds and removes pair up per node."""
    events.sort(key=lambda e: e.t)
    live: set[str] = set()
    for ev in events:
        if ev.kind == ADD:
            if ev.node in live:
                raise TraceError(f"{where}: node {ev.node} added at {ev.t:g} s while already live")
            live.add(ev.node)
        else:
            if ev.node not in live:
                raise TraceError(f"{where}: node {ev.node} removed at {ev.t:g} s but never added")
            live.discard(ev.node)
    return tuple(events)


# --- readers ------------------------------------------------------------------------------
def read_bamboo_csv(text: str, name: str = "trace", pool: str = "trace") -> Trace:
    events: list[TraceEvent] = []
    for lineno, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != 3:
            raise TraceError(f"{name}:{lineno}: expected time_ms,add|remove,node, got {row!r}")
        raw_t, kind, node = (c.strip() for c in row)
        try:
            t_ms = float(raw_t)
        except ValueError:
            raise TraceError(f"{name}:{lineno}: time {raw_t!r} is not a number of ms") from None
        if not math.isfinite(t_ms) or t_ms < 0:
            raise TraceError(f"{name}:{lineno}: time {raw_t!r} must be finite and >= 0")
        if kind not in (ADD, REMOVE):
            raise TraceError(f"{name}:{lineno}: event {kind!r} is not add or remove")
        if not node:
            raise TraceError(f"{name}:{lineno}: empty node name")
        events.append(TraceEvent(t_ms / 1000.0, kind, node, pool))
    if not events:
        raise TraceError(f"{name}: no events")
    checked = _checked(events, name)
    # The trace runs until its last event: nothing after it is known.
    return Trace(name, checked, checked[-1].t, TraceFormat.BAMBOO_CSV.value)


def series_to_trace(counts: Sequence[int], gap_s: float, name: str = "trace", pool: str = "trace") -> Trace:
    """A per-tick node count as add/remove events (the newest node is removed first)."""
    events: list[TraceEvent] = []
    live: list[str] = []
    serial = 0
    for i, count in enumerate(counts):
        t = i * gap_s
        while len(live) < count:
            serial += 1
            live.append(f"{pool}-n{serial}")
            events.append(TraceEvent(t, ADD, live[-1], pool))
        while len(live) > count:
            events.append(TraceEvent(t, REMOVE, live.pop(), pool))
    return Trace(name, tuple(events), len(counts) * gap_s, TraceFormat.AVAILABILITY_JSON.value)


def read_availability_json(
    text: str, meaning: ValueMeaning | str = ValueMeaning.AVAILABLE, name: str = "trace"
) -> Trace:
    meaning = ValueMeaning(meaning)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{name}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise TraceError(f'{name}: expected {{"metadata": {{"gap_seconds": G}}, "data": [...]}}')
    gap = (doc.get("metadata") or {}).get("gap_seconds")
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not gap > 0:
        raise TraceError(f"{name}: metadata.gap_seconds must be a positive number, got {gap!r}")
    counts: list[int] = []
    for i, v in enumerate(doc["data"]):
        if isinstance(v, bool):
            v = int(v)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or v != int(v):
            raise TraceError(f"{name}: data[{i}] = {v!r} is not a non-negative whole number")
        v = int(v)
        if meaning is ValueMeaning.COUNT:
            counts.append(v)
        elif v not in (0, 1):
            raise TraceError(
                f"{name}: data[{i}] = {v} but meaning {meaning.value!r} takes 0/1 only "
                "(use --trace-values count for node counts)"
            )
        else:
            counts.append(v if meaning is ValueMeaning.AVAILABLE else 1 - v)
    if not counts:
        raise TraceError(f"{name}: data is empty")
    return series_to_trace(counts, float(gap), name)


def detect_format(text: str) -> TraceFormat:
    return TraceFormat.AVAILABILITY_JSON if text.lstrip().startswith("{") else TraceFormat.BAMBOO_CSV


BUNDLED_DIR = Path(__file__).resolve().parent.parent / "data" / "traces"


def resolve_trace_path(path: Path | str) -> Path:
    """``path`` if it exists, else a bundled trace of that name (``p3``, ``p3-trace.csv``)."""
    path = Path(path)
    if path.exists():
        return path
    for candidate in (path.name, f"{path.name}.csv", f"{path.name}-trace.csv"):
        bundled = BUNDLED_DIR / candidate
        if bundled.is_file():
            return bundled
    names = ", ".join(sorted(p.name for p in BUNDLED_DIR.glob("*-trace.csv")))
    raise TraceError(f"trace {path} does not exist (bundled traces: {names})")


def load_trace(path: Path | str, meaning: ValueMeaning | str = ValueMeaning.AVAILABLE) -> Trace:
    """Read a trace file of either format (detected from its content)."""
    path = resolve_trace_path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from None
    name = path.stem
    if detect_format(text) is TraceFormat.AVAILABILITY_JSON:
        return read_availability_json(text, meaning, name)
    return read_bamboo_csv(text, name)


# --- synthetic traces ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SyntheticPool:
    """One pool's interruption process.

    Interruptions arrive as a Poisson process (``interruptions_per_hour`` while the pool has
    capacity). Each one is pool-wide with probability ``pool_wide_share`` (every node goes,
    as in real traces where nodes of a pool leave together), else it takes a single node.
    Lost capacity comes back after an exponential outage with mean ``mean_outage_s``.
    """

    name: str
    nodes: int = 1
    interruptions_per_hour: float = 0.5
    mean_outage_s: float = 3600.0
    pool_wide_share: float = 0.9


def synthetic_trace(pools: Iterable[SyntheticPool], duration_s: float, seed: int = 0, name: str = "synthetic") -> Trace:
    rng = random.Random(seed)
    events: list[TraceEvent] = []
    for pool in pools:
        if pool.nodes < 1 or pool.interruptions_per_hour < 0 or pool.mean_outage_s <= 0:
            raise ValueError(f"pool {pool.name}: nodes >= 1, rate >= 0 and outage > 0 required")
        serial = 0
        live: list[str] = []
        returns: list[float] = []  # times at which lost nodes come back (one entry per node)

        def add(t: float, pool: SyntheticPool = pool, live: list[str] = live) -> None:
            nonlocal serial
            serial += 1
            live.append(f"{pool.name}-n{serial}")
            events.append(TraceEvent(t, ADD, live[-1], pool.name))

        for _ in range(pool.nodes):
            add(0.0)
        t = 0.0
        rate_per_s = pool.interruptions_per_hour / 3600.0
        while True:
            # Next interruption (only possible while something is live) vs. next return.
            next_return = min(returns) if returns else math.inf
            if live and rate_per_s > 0:
                t_int = t + rng.expovariate(rate_per_s)
            else:
                t_int = math.inf
            t = min(t_int, next_return)
            if t >= duration_s:
                break
            if t == next_return:
                returns.remove(next_return)
                add(t)
                continue
            victims = len(live) if rng.random() < pool.pool_wide_share else 1
            outage = rng.expovariate(1.0 / pool.mean_outage_s)
            for _ in range(victims):
                events.append(TraceEvent(t, REMOVE, live.pop(), pool.name))
                returns.append(t + outage)
    return Trace(name, _checked(events, name), duration_s, "synthetic")


def all_or_none_share(trace: Trace, pool: str, pool_size: int, step_s: float = 60.0) -> float:
    """Share of time a pool has all of its nodes or none (sampled every ``step_s``)."""
    per_pool = Trace(pool, tuple(e for e in trace.events if e.pool == pool), trace.duration_s)
    samples = max(1, int(trace.duration_s // step_s))
    hits = sum(1 for i in range(samples) if per_pool.live_at(i * step_s) in (0, pool_size))
    return hits / samples
