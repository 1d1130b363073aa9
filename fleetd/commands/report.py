"""`fleetd report [--json] [--plot FILE.png]`: spend, savings against on-demand, goodput and the
scaling decisions, from the ledger.

The same numbers as `fleetd status`, /metrics and the demo report for the same run: one ledger,
one billing function (fleetd.policy.ledger). A node whose end fleetd never recorded is billed up to
the last time fleetd saw it alive, never to "now", and the report names it."""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetd.commands.common import add_config_argument
from fleetd.config import DEFAULT_PATH

if TYPE_CHECKING:
    from fleetd.policy.ledger import LedgerEvent


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p, DEFAULT_PATH)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--at",
        type=float,
        default=None,
        metavar="EPOCH_S",
        help="accrue running instances up to this time (default: now)",
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="also draw spend, nodes by market and progress over time (needs matplotlib)",
    )


class LedgerUnreadable(Exception):
    """The config or the ledger could not be read: ``code`` is the command's exit status."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def read_ledger(path: Path | None, at: float | None) -> tuple[Any, float, list[LedgerEvent], dict[str, float]]:
    """The controller's config, the report's time, the ledger's events and when each instance was
    last seen billing: SQLite on one control host, the shared table under HA. Raises
    LedgerUnreadable (report and `job list` print it)."""
    from fleetd.config import load
    from fleetd.shared.settings import ConfigError

    # Without an explicit file, a host with no /etc/fleetd/fleetd.toml still reports from the
    # environment (FLEETD_FLEET__STATE_DIR) and defaults.
    if path == DEFAULT_PATH and not DEFAULT_PATH.exists():
        path = None
    try:
        cfg = load(path)
    except ConfigError as exc:
        raise LedgerUnreadable(2, exc.render()) from None
    now = at if at is not None else time.time()
    return (cfg, now, *ledger_of(cfg))


def ledger_of(cfg: Any) -> tuple[list[LedgerEvent], dict[str, float]]:
    """The ledger's events and when each instance was last seen billing, for a loaded config
    (SQLite in its state directory, the shared table under HA). Raises LedgerUnreadable."""
    import asyncio

    from fleetd.reconcile.ledger_store import DB_NAME, LedgerStore, LedgerStoreError

    if cfg.ha.backend == "dynamodb":
        from fleetd.adapters.aws_errors import AwsError

        try:
            return _read_shared(cfg)
        except AwsError as exc:
            raise LedgerUnreadable(1, f"cannot read the shared state ({cfg.ha.table}): {exc}") from None
    db = cfg.fleet.state_dir / DB_NAME
    if not db.is_file():
        raise LedgerUnreadable(1, f"no ledger at {db} (has fleetd run with this state_dir?)")

    async def read() -> tuple[list[LedgerEvent], dict[str, float]]:
        seen = await asyncio.to_thread(_observed_until, db)
        store = await LedgerStore.open(db)
        try:
            events = await store.events()
        finally:
            await store.close()
        return events, seen

    try:
        return asyncio.run(read())
    except (LedgerStoreError, sqlite3.Error) as exc:
        raise LedgerUnreadable(1, str(exc)) from None


def run(args: argparse.Namespace) -> int:
    try:
        cfg, now, events, seen = read_ledger(args.config, args.at)
    except LedgerUnreadable as exc:
        print(str(exc) if exc.code == 2 else f"fleetd report: {exc}", file=sys.stderr)
        return exc.code
    return _finish(args, cfg, now, events, seen)


def _read_shared(cfg: Any) -> tuple[list[LedgerEvent], dict[str, float]]:
    """HA: the ledger and the instances' last-seen times from the shared table (reads only)."""
    import asyncio

    from fleetd.ha.compose import open_ha

    async def read() -> tuple[list[LedgerEvent], dict[str, float]]:
        ha = await open_ha(cfg)
        try:
            await ha.state.refresh()
            return await ha.ledger.events(), ha.state.observed_until_sync()
        finally:
            await ha.close()

    return asyncio.run(read())


def _finish(args: argparse.Namespace, cfg: Any, now: float, events: list[LedgerEvent], seen: dict[str, float]) -> int:
    from fleetd.policy import ledger

    summary = ledger.summarize(events, now, seen)
    if args.plot is not None:
        try:
            from fleetd.commands.report_plot import plot
        except ImportError as exc:
            print(f"fleetd report: --plot needs matplotlib (pip install 'fleetd[plot]'): {exc}", file=sys.stderr)
            return 2
        plot(events, now, seen, args.plot)
    data = {
        **summary.as_json(),
        "stall": stall_summary(cfg.fleet.state_dir),
        "job": job_json(cfg.fleet.state_dir),
        "job_history": job_history(events),
    }
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(render_table(data))
    return 0


def _observed_until(db: Path) -> dict[str, float]:
    """When fleetd last knew each instance billed (fleetd.reconcile.state_sql.observed_until), read
    only: the report must never take a lock the running daemon waits on."""
    from fleetd.reconcile.state_sql import observed_until

    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        has = conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='instances'").fetchone()
        return observed_until(conn) if has else {}
    finally:
        conn.close()


def stall_summary(state_dir: Path) -> dict[str, Any]:
    """Billed time without a step, from fleetd's stall watcher (stalls.json). "unknown" when the
    watcher never wrote one: a run nobody watched is not reported as stall-free."""
    from fleetd.protocol.errors import ProtocolError
    from fleetd.stall_record import read_stalls

    try:
        record = read_stalls(state_dir)
    except ProtocolError as exc:
        return {"known": False, "error": str(exc)}
    if record is None:
        return {"known": False}
    episodes = [*record.episodes, *([record.current] if record.current is not None else [])]
    return {
        "known": True,
        "stalled_now": record.stalled,
        "stalls": record.stalls,
        "stalled_node_seconds": record.stalled_node_seconds,
        "episodes": [{**e.model_dump(), "duration_s": e.duration_s, "recovery_s": e.recovery_s} for e in episodes],
    }


def _stalled(stall: dict[str, Any] | None) -> str:
    if not stall or not stall.get("known"):
        return "unknown (no stall record)"
    text = f"{stall['stalled_node_seconds'] / 3600:.3f} node-h in {stall['stalls']} stall(s)"
    return text + (" (stalled now)" if stall["stalled_now"] else "")


def _steps_lost(data: dict[str, Any]) -> str:
    """A stalled run did not lose "0 steps": its billed time trained nothing. Say so."""
    lost = f"{data['steps_lost']:,}"
    stall = data.get("stall") or {}
    if stall.get("known") and stall.get("stalls"):
        return f"{lost} rolled back, plus {stall['stalled_node_seconds'] / 3600:.3f} node-h stalled (no step)"
    return lost  # the "stalled node-time" row says whether stalls are known


def job_json(state_dir: Path) -> dict[str, Any] | None:
    """The job's lifecycle state (job.json), or None before the daemon wrote one."""
    from fleetd.job_record import read_job
    from fleetd.protocol.errors import ProtocolError

    try:
        view = read_job(state_dir)
    except ProtocolError as exc:
        return {"state": "unknown", "reason": str(exc)}
    return view.model_dump(mode="json") if view is not None else None


def job_history(events: list[LedgerEvent]) -> list[dict[str, Any]]:
    """The job's state changes as the ledger recorded them, oldest first."""
    from fleetd.policy.ledger import JobStateChanged

    changes = sorted((e for e in events if isinstance(e, JobStateChanged)), key=lambda e: e.at)
    return [
        {
            "at": e.at,
            "state": e.state,
            "reason": e.reason,
            "restarts": e.restarts,
            "step": e.step,
            "code_digest": e.code_digest,
        }
        for e in changes
    ]


def render_table(data: dict[str, Any]) -> str:
    def usd(x: float) -> str:
        return f"${x:,.2f}"

    per_1k = data["usd_per_1k_steps"]
    job = data.get("job")
    rows = [
        ("job", f"{job['state']}" + (f" ({job['reason']})" if job.get("reason") else "") if job else "unknown"),
        ("spend", usd(data["spend_usd"])),
        ("on-demand equivalent", usd(data["on_demand_equivalent_usd"])),
        ("savings vs on-demand", f"{data['savings_pct']:.1f} %"),
        ("node-hours billed", f"{data['node_seconds'] / 3600:.2f}"),
        ("instances", str(data["instances"])),
        ("useful steps", f"{data['useful_steps']:,}"),
        ("steps lost", _steps_lost(data)),
        ("stalled node-time", _stalled(data.get("stall"))),
        ("time in recovery", f"{data['recovery_s']:.1f} s"),
        ("idle GPU time", f"{data['idle_gpu_s']:.1f} GPU-s"),
        ("USD per 1,000 useful steps", "n/a (no useful steps)" if per_1k is None else usd(per_1k)),
    ]
    for market, value in data["spend_by_market"].items():
        rows.append((f"spend on {market}", usd(value)))
    for pool, value in data["spend_by_pool"].items():
        rows.append((f"spend in {pool}", usd(value)))
    width = max(len(k) for k, _ in rows)
    lines = ["fleetd cost and goodput report", ""]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    unseen = data.get("instances_end_unseen") or []
    if unseen:
        last = max(u["billed_until"] for u in unseen)
        lines += [
            "",
            f"{len(unseen)} node(s) whose end fleetd has not seen (it stopped first, or has not "
            f"looked since) are billed only up to when it last saw them alive, or their 60 s minimum (the latest "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(last))} UTC): "
            + ", ".join(u["instance_id"] for u in unseen),
        ]
    history = data.get("job_history") or []
    if history:
        lines += ["", "job states:"]
        for h in history:
            when = time.strftime("%H:%M:%S", time.gmtime(h["at"]))
            step = f" at step {h['step']:,}" if h.get("step") is not None else ""
            why = f": {h['reason']}" if h.get("reason") else ""
            lines.append(f"  {when}  {h['state']}{step}{why}")
    decisions = data.get("scaling_decisions") or []
    lines += ["", f"scaling decisions: {len(decisions) or 'none'}"]
    for d in decisions:
        when = time.strftime("%H:%M:%S", time.gmtime(d["at"]))
        lines.append(f"  {when}  {d['from']} -> {d['to']}: {d['reason']}")
    return "\n".join(lines)
