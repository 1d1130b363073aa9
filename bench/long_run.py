"""A simulated week of one fleet on a fast clock: what the state DB, the ledger, `fleetd report`,
`fleetd status` and the controller's memory cost as days pass.

    nice .venv/bin/python bench/long_run.py [--days 7] [--nodes 32] [--notices-per-day 300]

The real reconcile loop (planner, SQLite state, ledger, node registry, drain journal) runs pass
after pass against the in-memory EC2 (fleetd/adapters/ec2_fake.py) on a virtual clock that
advances ``--interval`` per pass. Agents are simulated at the registry: status and telemetry every
pass, a spot notice every 86400 / notices-per-day s (AWS reclaims the node 120 s later), a drained
node says ``leaving`` on the next pass (so fleetd terminates it). The planner buys replacements.
At the end of every simulated day: DB size, ledger rows, RSS, and `fleetd report` / `fleetd
status` run as real processes against the state directory. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleetd.adapters.ec2 import LaunchSpec  # noqa: E402
from fleetd.adapters.ec2_fake import FakeEc2  # noqa: E402
from fleetd.adapters.pricing import FilePriceBook  # noqa: E402
from fleetd.config import BudgetConfig, CapacityConfig, FleetConfig, FleetdConfig  # noqa: E402
from fleetd.intake.events import AgentStatus, AgentTelemetry, InterruptionNotice  # noqa: E402
from fleetd.intake.registry import NodeRegistry  # noqa: E402
from fleetd.intake.signals import TrainingSignals  # noqa: E402
from fleetd.metrics import FleetMetrics  # noqa: E402
from fleetd.policy.model import Market  # noqa: E402
from fleetd.policy.planner import plan  # noqa: E402
from fleetd.protocol.messages import Status, Telemetry  # noqa: E402
from fleetd.publish import PassPublisher  # noqa: E402
from fleetd.reconcile.ledger_store import DB_NAME, LedgerStore  # noqa: E402
from fleetd.reconcile.loop import Reconciler  # noqa: E402
from fleetd.reconcile.state import StateStore  # noqa: E402

DAY = 86400.0


class Agents:
    """The agents' side, at the registry: what fleetd would hear over MQTT."""

    def __init__(self, registry: NodeRegistry, clock):
        self.registry = registry
        self.clock = clock
        self.drained: dict[str, float] = {}
        self.step = 0
        self.drains = 0

    # NodeCommander
    async def request_checkpoint(self, deadline, reason) -> None:
        pass

    async def drain(self, instance_id, deadline, reason, msg_id=None) -> None:
        self.drains += 1
        self.drained.setdefault(instance_id, self.clock())

    def node_state(self, instance_id):
        rec = self.registry.record(instance_id)
        return rec.status.state if rec is not None and rec.status is not None else None

    async def stop_job(self, reason) -> None:
        pass

    def report(self, live: list[str]) -> None:
        now = self.clock()
        self.step += 10
        for iid in live:
            rec = self.registry.record(iid)
            state = "leaving" if iid in self.drained and now > self.drained[iid] else "training"
            if rec is None or rec.status is None or rec.status.state != state:
                self.registry.apply(AgentStatus(iid, Status(instance_id=iid, state=state), received_at=now))
            self.registry.apply(
                AgentTelemetry(
                    iid,
                    Telemetry(instance_id=iid, step=self.step, steps_per_s=1.0, world_size=len(live)),
                    received_at=now,
                )
            )


def forget_ended(ec2, agents: Agents, ended_at: dict[str, float], now: float) -> None:
    """The harness forgets what EC2 and a node forget: DescribeInstances stops listing a
    terminated instance about an hour after it ended, and a node's drain goes with the node. Without
    this the fake cloud and agents grew per launch and their growth was counted as fleetd's."""
    for iid, inst in list(ec2.instances.items()):
        if inst.state == "terminated":
            if now - ended_at.setdefault(iid, now) > 3600.0:
                del ec2.instances[iid]
                del ended_at[iid]
                agents.drained.pop(iid, None)
    ec2.calls.clear()


def db_bytes(state_dir: Path) -> int:
    return sum(p.stat().st_size for p in state_dir.glob(f"{DB_NAME}*"))


def rows(state_dir: Path) -> dict[str, int]:
    db = sqlite3.connect(state_dir / DB_NAME)
    try:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return {t: db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables}
    finally:
        db.close()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def sqlite_mib() -> float | None:
    """What SQLite itself holds in this process (page caches, statements): sqlite3_memory_used
    of the library Python's sqlite3 is linked with. None where it cannot be reached."""
    try:
        import _sqlite3
        import ctypes

        used = ctypes.CDLL(_sqlite3.__file__).sqlite3_memory_used
        used.restype = ctypes.c_int64
        return round(used() / 2**20, 2)
    except (ImportError, OSError, AttributeError):
        return None


def memory_growth(day1: tracemalloc.Snapshot, days: int, top: int = 12) -> list[dict]:
    """Where the Python heap grew between the end of day 1 and now, per simulated day, by allocation
    site: the answer to "what grows per event" (RSS alone cannot say; the allocator keeps freed pages)."""
    gc.collect()
    stats = tracemalloc.take_snapshot().compare_to(day1, "traceback")
    out = []
    for s in sorted(stats, key=lambda s: s.size_diff, reverse=True)[:top]:
        # tracemalloc lists a traceback oldest frame first: the allocation site is the last one.
        frames = [f"{Path(f.filename).name}:{f.lineno}" for f in reversed(s.traceback)]
        out.append(
            {
                "kib_per_day": round(s.size_diff / 1024 / max(1, days - 1), 1),
                "blocks_diff": s.count_diff,
                "where": " <- ".join(frames),
            }
        )
    return out


def timed(argv: list[str]) -> tuple[float, int]:
    t = time.perf_counter()
    r = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(Path(__file__).resolve().parent.parent))},
    )
    return round(time.perf_counter() - t, 3), r.returncode


async def main(a: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="fleetd-long-run-"))
    state_dir = work / "state"
    book = FilePriceBook.demo()
    pools = tuple(p for p in book.pools if p.instance_type in ("g4dn.xlarge", "g5.xlarge", "g6.xlarge"))
    t = [time.time()]
    clock = lambda: t[0]  # noqa: E731
    ec2 = FakeEc2(clock)
    await ec2.launch(LaunchSpec("seed", a.nodes, Market.SPOT, pools[:1]))
    cfg = FleetdConfig(
        fleet=FleetConfig(
            name="week", min_nodes=a.nodes, max_nodes=a.nodes, state_dir=state_dir, reconcile_interval_s=a.interval
        ),
        capacity=CapacityConfig(
            instance_types=tuple(sorted({p.instance_type for p in pools})), zones=("us-east-1a", "us-east-1b")
        ),
        budget=BudgetConfig(total_usd=1e9, max_usd_per_hour=1e6),
    )
    conf = work / "fleetd.toml"
    conf.write_text(
        f'[fleet]\nname = "week"\nmin_nodes = {a.nodes}\nmax_nodes = {a.nodes}\n'
        f'state_dir = "{state_dir}"\n[budget]\ntotal_usd = 1000000000.0\nmax_usd_per_hour = 1000000.0\n'
    )
    registry = NodeRegistry(clock=clock)
    agents = Agents(registry, clock)
    state = await StateStore.open(state_dir)
    ledger = await LedgerStore.open(state_dir / DB_NAME)
    r = Reconciler(
        cfg,
        ec2=ec2,
        prices=book,
        state=state,
        pools=pools,
        hardware={p.instance_type: book.hardware(p.instance_type) for p in pools},
        planner=plan,
        clock=clock,
        observer=registry,
        signals=TrainingSignals(registry, 1),
        commander=agents,
        ledger=ledger,
    )
    publisher = PassPublisher(cfg, FleetMetrics("week"))
    rng = random.Random(a.seed)
    start = t[0]
    notice_every = DAY / a.notices_per_day
    next_notice = start + notice_every
    reclaim: dict[str, float] = {}
    ended_at: dict[str, float] = {}  # terminated instances the fake cloud still lists, since when
    notices = 0
    days: list[dict] = []
    pass_s: list[float] = []
    wall0 = time.monotonic()
    load0 = os.getloadavg()
    report = None
    if a.trace_memory:
        tracemalloc.start(a.trace_memory)
    first_snapshot = None
    while t[0] < start + a.days * DAY:
        live = [i.instance_id for i in ec2.live()]
        agents.report(live)
        while t[0] >= next_notice:
            candidates = [i for i in live if i not in reclaim]
            if candidates:
                iid = rng.choice(candidates)
                registry.apply(
                    InterruptionNotice(
                        iid, "terminate", t[0] + 120.0, "imds", received_at=t[0], dedup_key=f"notice-{iid}"
                    )
                )
                reclaim[iid] = t[0] + 120.0
                notices += 1
            next_notice += notice_every
        for iid, at in list(reclaim.items()):
            if t[0] >= at:
                if iid in ec2.instances and ec2.instances[iid].live:
                    ec2.interrupt(iid)
                del reclaim[iid]
        forget_ended(ec2, agents, ended_at, t[0])
        p0 = time.perf_counter()
        report = await r.run_pass()
        pass_s.append(time.perf_counter() - p0)
        t[0] += a.interval
        if t[0] >= start + (len(days) + 1) * DAY:
            await publisher.publish(report, r)
            gc.collect()
            status_s, status_rc = timed(
                [sys.executable, "-m", "fleetd.cli", "status", "--state-dir", str(state_dir), "--json"]
            )
            report_s, report_rc = timed(
                [sys.executable, "-m", "fleetd.cli", "report", "--config", str(conf), "--json", "--at", str(t[0])]
            )
            table_rows = rows(state_dir)
            launched = table_rows["instances"]  # every instance fleetd recorded (the fake cloud forgets)
            day = {
                "day": len(days) + 1,
                "db_mib": round(db_bytes(state_dir) / 2**20, 2),
                "db_main_mib": round((state_dir / DB_NAME).stat().st_size / 2**20, 2),
                "rows": table_rows,
                "rss_mib": rss_mib(),
                "sqlite_mib": sqlite_mib(),
                "launched_total": launched,
                "notices_total": notices,
                "registry_nodes": len(registry.records()),
                "status_s": status_s,
                "status_rc": status_rc,
                "report_s": report_s,
                "report_rc": report_rc,
                "pass_p50_s": round(sorted(pass_s)[len(pass_s) // 2], 4),
                "pass_max_s": round(max(pass_s), 4),
                "loadavg": [round(x, 2) for x in os.getloadavg()],
            }
            pass_s.clear()
            if a.trace_memory:
                day["traced_mib"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 2)
                if first_snapshot is None:
                    first_snapshot = tracemalloc.take_snapshot()
            days.append(day)
            print(json.dumps(day), flush=True)
    growth = memory_growth(first_snapshot, a.days) if a.trace_memory and first_snapshot else []
    await ledger.close()
    await state.close()
    first, last = days[0], days[-1]
    per_day = lambda k: round((last[k] - first[k]) / max(1, len(days) - 1), 3)  # noqa: E731
    return {
        "days": a.days,
        "nodes": a.nodes,
        "interval_s": a.interval,
        "launches": days[-1]["launched_total"] - a.nodes,
        "notices": notices,
        "drains": agents.drains,
        "db_mib_end": last["db_mib"],
        "db_mib_per_day": per_day("db_mib"),
        "ledger_rows_end": last["rows"].get("ledger_events"),
        "rss_mib_day1": first["rss_mib"],
        "rss_mib_end": last["rss_mib"],
        "rss_mib_per_day": per_day("rss_mib"),
        "sqlite_mib_day1": first["sqlite_mib"],
        "sqlite_mib_end": last["sqlite_mib"],
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "status_s_day1": first["status_s"],
        "status_s_end": last["status_s"],
        "report_s_day1": first["report_s"],
        "report_s_end": last["report_s"],
        "commands_ok": all(d["status_rc"] == 0 and d["report_rc"] == 0 for d in days),
        "wall_s": round(time.monotonic() - wall0, 1),
        "loadavg_start": [round(x, 2) for x in load0],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "memory_growth_top": growth,
        "per_day": days,
        "state_dir": str(state_dir),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--days", type=int, default=7)
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--interval", type=float, default=60.0, help="virtual seconds per reconcile pass")
    ap.add_argument("--notices-per-day", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--trace-memory",
        type=int,
        default=0,
        metavar="FRAMES",
        help="trace Python allocations (tracemalloc, this many frames) and list what grew after day 1",
    )
    args = ap.parse_args()
    out = asyncio.run(main(args))
    print(
        f"{out['days']} simulated days, {out['nodes']} nodes: {out['launches']} launches, {out['notices']} notices; "
        f"DB {out['db_mib_end']} MiB (+{out['db_mib_per_day']}/day), RSS {out['rss_mib_day1']} -> {out['rss_mib_end']} "
        f"MiB; report {out['report_s_day1']} -> {out['report_s_end']} s, status {out['status_s_day1']} -> "
        f"{out['status_s_end']} s (load {out['loadavg_start']} -> {out['loadavg_end']})"
    )
    print(json.dumps(out))
