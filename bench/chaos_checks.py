"""The chaos bench's invariants, each read from the system itself (never from the bench's own
bookkeeping): EC2 (moto, directly), fleetd's state DB (read-only), the trainers' event trace,
S3, fleetd's status snapshot, the process table."""

from __future__ import annotations

import json
import sqlite3
import tempfile
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import psutil

from fleetd.demo import configs

LIVE = ("pending", "running")


class EventTail:
    """The trainers' JSON-lines trace, read incrementally (the bench polls it every second)."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = b""
        self.records: list[dict] = []

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self.records
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a SIGKILLed writer
            if isinstance(rec, dict) and "ev" in rec and "t" in rec:
                self.records.append(rec)
        return self.records

    def steps(self) -> list[tuple[float, int]]:
        return sorted((r["t"], int(r["step"])) for r in self.records if r["ev"] == "step")

    def last_step(self) -> int:
        s = self.steps()
        return s[-1][1] if s else 0


def training_again_at(
    steps: list[tuple[float, int]], after: float, now: float, window_s: float, gap_s: float
) -> float | None:
    """The start of the first stretch of steady stepping (no gap over ``gap_s``) that lasts
    ``window_s`` and is still going at ``after + window_s``; ``after`` itself if training was never
    interrupted. None: not (yet) training steadily again."""
    times = [t for t, _ in steps if t >= after - gap_s]
    if not times:
        return None
    start = times[0]
    prev = times[0]
    for t in times[1:]:
        if t - prev > gap_s:
            start = t
        prev = t
        if prev - max(start, after) >= window_s:
            return max(start, after)
    if now - prev <= gap_s and prev - max(start, after) >= window_s:
        return max(start, after)
    return None


def steady_now(steps: list[tuple[float, int]], now: float, window_s: float, gap_s: float) -> bool:
    """Training has stepped without a gap over ``gap_s`` for the last ``window_s`` seconds."""
    times = [t for t, _ in steps if t >= now - window_s - gap_s]
    if not times or now - times[-1] > gap_s or times[0] > now - window_s:
        return False
    return all(b - a <= gap_s for a, b in pairwise(times))


def steps_lost(records: list[dict], since: float, until: float) -> int:
    """Steps completed before the fault (at ``since``) that had to be done again: the highest step
    completed before it, minus the step that the world which next went past it resumed from.
    A world that re-formed from an older step and was then replaced by one resuming from a peer's
    newer state (the survivors' salvage) redid nothing, so it costs nothing here."""
    before = max((int(r["step"]) for r in records if r["ev"] == "step" and r["t"] < since), default=0)
    window = sorted((r for r in records if since <= r["t"] <= until), key=lambda r: r["t"])
    starts = [r for r in window if r["ev"] in ("start", "resumed") and "from_step" in r]
    beyond = next((r for r in window if r["ev"] == "step" and int(r["step"]) > before), None)
    if beyond is None:  # not past it yet: the best resumption point so far
        return max(0, before - max(int(r["from_step"]) for r in starts)) if starts else 0
    own = [r for r in starts if r.get("pid") == beyond.get("pid") and r["t"] <= beyond["t"]]
    return max(0, before - int(own[-1]["from_step"])) if own else 0  # no restart: nothing redone


def resumptions(records: list[dict], since: float, until: float) -> list[str]:
    """What each node saved and resumed from after a fault, in order ("node: salvaged 887",
    "node: world 1 from 800"): the evidence behind a steps_lost, printed when it is not 0."""
    out = []
    for r in sorted((r for r in records if since <= r["t"] <= until), key=lambda r: r["t"]):
        node = r.get("node", "?")
        if r["ev"] == "salvaged":
            out.append(f"{node}: salvaged {r.get('step')}")
        elif r["ev"] in ("awaiting_salvage", "salvage_durable", "salvage_unreachable"):
            out.append(f"{node}: {r['ev']} {r.get('step')} (+{r['t'] - since:.1f} s)")
        elif r["ev"] == "start" and "from_step" in r:
            out.append(
                f"{node}: rank {r.get('rank')} of {r.get('world')} from {r['from_step']} (+{r['t'] - since:.1f} s)"
            )
    return out


def _db_rows(db: Path) -> dict[str, dict]:
    """fleetd's instances, read-only (fleetd keeps writing while we read: WAL allows it)."""
    if not db.exists():
        return {}
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        cur = conn.execute(
            "SELECT instance_id, ended_at, notice_at, drain_started_at, terminate_requested_at,"
            " launch_token FROM instances"
        )
        return {
            r[0]: {
                "ended_at": r[1],
                "notice_at": r[2],
                "drain_started_at": r[3],
                "terminate_requested_at": r[4],
                "launch_token": r[5],
            }
            for r in cur
        }
    except sqlite3.Error:
        return {}
    finally:
        conn.close()


def _launch_counts(db: Path) -> dict[str, int]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return {r[0]: r[1] for r in conn.execute("SELECT token, count FROM launches")}
    except sqlite3.Error:
        return {}
    finally:
        conn.close()


def _tag(inst: dict, key: str) -> str | None:
    return next((t["Value"] for t in inst.get("Tags", []) if t["Key"] == key), None)


def orphan_candidates(instances: list[dict], db: Path) -> set[str]:
    """Instances EC2 runs for the fleet that fleetd has no open record of."""
    rows = _db_rows(db)
    return {
        i["InstanceId"]
        for i in instances
        if i["State"]["Name"] in LIVE and (i["InstanceId"] not in rows or rows[i["InstanceId"]]["ended_at"] is not None)
    }


@dataclass
class DuplicateWatch:
    """Sampled all run long: more active nodes than the fleet's maximum, or a launch token
    holding more instances than its launch asked for (a purchase made twice)."""

    max_nodes: int
    excess: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)

    def sample(self, instances: list[dict], db: Path) -> None:
        rows = _db_rows(db)
        live = [i for i in instances if i["State"]["Name"] in LIVE]
        active = sorted(
            i["InstanceId"]
            for i in live
            if not any(
                rows.get(i["InstanceId"], {}).get(k)
                for k in ("notice_at", "drain_started_at", "terminate_requested_at")
            )
        )
        if len(active) > self.max_nodes:
            extra = set(active[self.max_nodes :])
            if not extra <= self.excess:
                self.notes.append(f"{len(active)} active nodes > max {self.max_nodes}: {active}")
            self.excess |= extra
        counts = _launch_counts(db) if db.exists() else {}
        by_token: dict[str, list[str]] = {}
        for i in instances:
            token = _tag(i, "fleetd:launch")
            if token:
                by_token.setdefault(token, []).append(i["InstanceId"])
        for token, ids in by_token.items():
            asked = counts.get(token)
            if asked is not None and len(ids) > asked:
                extra = set(sorted(ids)[asked:])
                if not extra <= self.excess:
                    self.notes.append(f"launch {token} holds {len(ids)} instances, asked {asked}")
                self.excess |= extra


async def checkpoint_check(stack) -> tuple[bool, str, int | None]:
    """Every step ``latest`` names must be complete: its manifest present and every file
    verifying (size and SHA-256), by restoring it the way a node does. Read from moto directly."""
    from agent.checkpoint_store import CheckpointStore
    from agent.config import AgentConfig

    with tempfile.TemporaryDirectory(prefix="chaos-ckpt-") as tmp:
        cfg = AgentConfig.model_validate(
            {
                "node": {"fleet": configs.DEMO_FLEET, "state_dir": tmp},
                "aws": {"region": "us-east-1", "endpoint_url": stack.moto_url},
                "checkpoints": {"bucket": configs.DEMO_BUCKET, "prefix": "checkpoints", "local_dir": f"{tmp}/ck"},
            }
        )
        async with CheckpointStore.connect(cfg.checkpoints, cfg.aws, job="toy") as store:
            latest, _ = await store.publisher.read_latest()
            if latest is None:
                return True, "no checkpoint yet", None
            restored = await store.restore_latest(Path(tmp) / "out")
    if restored is None:
        return False, f"latest names step {latest.step}; nothing restores", latest.step
    bad = [s for s in restored.skipped if s[0] == latest.step]
    if bad or restored.step < latest.step:
        return False, f"latest names step {latest.step}, incomplete: {bad or restored.skipped}", latest.step
    return True, f"step {latest.step} verifies", latest.step


def spend(workdir: Path) -> tuple[float | None, float | None]:
    from fleetd.demo.view import status_snapshot

    snap = status_snapshot(workdir)
    if snap is None or snap.budget is None:
        return None, None
    return snap.budget.spent_usd, snap.budget.total_usd


def strays(marker: str, value: str) -> list[str]:
    """Processes still alive that the bench started (every one inherits ``marker=value``)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.environ().get(marker) == value:
                out.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:160]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out
