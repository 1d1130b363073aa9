"""`fleetd status [--json]`: nodes, rendezvous round and budget, read from fleetd's state directory.

It never talks to the daemon or to AWS: it reads what the reconcile loop left in
``<fleet.state_dir>``, so it works while the daemon runs (and after it stopped, marked stale):

- ``status.json``, the snapshot the loop rewrites atomically every pass (fleetd/snapshot.py):
  nodes with telemetry, rendezvous round, budget;
- if there is no snapshot yet, ``fleetd.db``'s open instances (read-only), without telemetry or
  budget.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fleetd.commands.common import add_config_argument
from fleetd.config import DEFAULT_PATH

BAR_WIDTH = 30
LIVE = ("pending", "running")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p, DEFAULT_PATH)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="read this state directory instead of fleet.state_dir from the config",
    )


def run(args: argparse.Namespace) -> int:
    from fleetd.protocol.errors import ProtocolError
    from fleetd.shared.settings import ConfigError

    try:
        state_dir, fleet, interval = _where(args)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return 2
    try:
        report = collect(state_dir, now=time.time(), fleet=fleet, reconcile_interval_s=interval)
    except (ProtocolError, sqlite3.Error) as exc:
        print(f"fleetd status: cannot read fleetd's state in {state_dir}: {exc}", file=sys.stderr)
        return 1
    if report is None:
        print(f"fleetd status: no state in {state_dir} yet (has `fleetd run` started?)", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2, sort_keys=True) if args.json else render(report))
    return 0


def _where(args: argparse.Namespace) -> tuple[Path, str | None, float | None]:
    if args.state_dir is not None:
        return args.state_dir, None, None
    from fleetd.config import load

    cfg = load(args.config)
    return cfg.fleet.state_dir, cfg.fleet.name, cfg.fleet.reconcile_interval_s


# ------------------------------------------------------------------ reading
def collect(
    state_dir: Path, *, now: float, fleet: str | None = None, reconcile_interval_s: float | None = None
) -> dict[str, Any] | None:
    """The status as plain JSON-able data; None when the daemon has left no state at all."""
    from fleetd.snapshot import read_snapshot

    snap = read_snapshot(state_dir)
    if snap is not None:
        interval = snap.reconcile_interval_s
        age = max(now - snap.written_at, 0.0)
        nodes = [n.model_dump() for n in snap.nodes]
        report: dict[str, Any] = {
            "source": "snapshot",
            "fleet": snap.fleet,
            "as_of": snap.written_at,
            "age_s": round(age, 1),
            # Three missed passes (plus slack for one slow pass) mean the loop is not running.
            "stale": age > 3 * interval + 30,
            "reconcile_interval_s": interval,
            "target_nodes": snap.target_nodes,
            "nodes": nodes,
            "rendezvous": snap.rendezvous.model_dump() if snap.rendezvous else None,
            "checkpoint": None,
            "budget": None,
            "pools": [p.model_dump() for p in snap.pools],
            "stall": _stall(snap.stall, now),
            "job": snap.job.model_dump() if snap.job is not None else None,
        }
        if snap.checkpoint is not None:
            report["checkpoint"] = {
                **snap.checkpoint.model_dump(),
                "age_s": round(max(now - snap.checkpoint.durable_at, 0.0), 1),
            }
        if snap.budget is not None:
            b = snap.budget
            report["budget"] = {
                **b.model_dump(),
                "left_usd": round(b.left_usd, 4),
                "hours_to_cap": None if b.hours_to_cap is None else round(b.hours_to_cap, 2),
            }
    else:
        db = Path(state_dir) / "fleetd.db"
        if not db.exists():
            return None
        report = {
            "source": "database",
            "fleet": fleet,
            "as_of": None,
            "age_s": None,
            "stale": None,
            "reconcile_interval_s": reconcile_interval_s,
            "target_nodes": None,
            "nodes": _nodes_from_db(db),
            "rendezvous": None,
            "checkpoint": None,
            "budget": None,
            "pools": None,  # unknown without a snapshot
            "stall": None,
            "job": None,
        }
    report["region"] = snap.region if snap is not None else None
    report["team"] = _team(state_dir, now, member=snap is not None and snap.team_member)
    live = [n for n in report["nodes"] if n["ec2_state"] in LIVE]
    report["node_count"] = len(live)
    report["nodes_by_state"] = _tally(n["state"] for n in live)
    report["spot_nodes"] = sum(1 for n in live if n["market"] == "spot")
    return report


def _team(state_dir: Path, now: float, member: bool = False) -> dict[str, Any] | None:
    """The team's allotment in force (fleetd/team/allotment_file.py), when the job is a team's
    (a member with none yet waits for it), and its move to another region, if it moved."""
    from fleetd.protocol.errors import ProtocolError
    from fleetd.team.allotment_file import read_allotment
    from fleetd.team.region_file import read_region

    try:
        record = read_allotment(state_dir)
        moved = read_region(state_dir)
    except (ProtocolError, OSError) as exc:
        return {"error": str(exc)[:300]}
    if record is None:
        return {"waiting": True} if member else None
    out = {**record.model_dump(exclude={"schema_version"}), "age_s": round(max(now - record.written_at, 0.0), 1)}
    if moved is not None:
        out["moved"] = moved.model_dump(exclude={"schema_version", "reason"})
    return out


def _team_line(team: dict[str, Any]) -> str:
    """Why a team's job trains with what it has, or not at all (a pause is not a stall)."""
    from fleetd.policy.team_share import NOT_TRAINING

    if "error" in team:
        return f"team: allotment unreadable ({team['error']}); the daemon keeps the last one it read"
    if team.get("waiting"):
        return "team: WAITING for its first allotment (is fleetd-team running?): nothing is bought until it comes"
    kind = str(team["kind"])
    waits = kind in {k.value for k in NOT_TRAINING}
    label = "PAUSED" if kind in ("pause", "paused") else kind.upper()
    head = f"team {team['team']}: {label}"
    if not waits:
        head += f", {team['nodes']} node(s) at most ${team['usd_per_hour']:.2f}/h"
    line = f"{head}, ${team['total_usd']:.2f} in all (allotted {team['age_s']:.0f} s ago): {team['reason']}"
    moved = team.get("moved")
    if moved:
        line += (
            f"\nregion {moved['region']}: moved from {moved['moved_from']} by the team "
            f"({moved['objects']} objects copied in {moved['copy_s']:.1f} s)"
        )
    return line


def _stall(stall: Any, now: float) -> dict[str, Any] | None:
    if stall is None:
        return None
    out: dict[str, Any] = stall.model_dump()
    cur = stall.current
    out["stalled_for_s"] = round(max(now - cur.since, 0.0), 1) if cur is not None else None
    last = stall.episodes[-1] if stall.episodes else None
    out["last"] = (
        None
        if last is None
        else {
            **last.model_dump(),
            "duration_s": last.duration_s and round(last.duration_s, 1),
            "recovery_s": last.recovery_s and round(last.recovery_s, 1),
        }
    )
    return out


def _job_line(job: dict[str, Any] | None) -> str:
    if job is None:
        return "job: unknown (no job watcher report)"
    line = f"job: {str(job['state']).upper()}"
    if job.get("reason"):
        line += f" ({job['reason']})"
    if job.get("code_digest"):
        line += f"; code {job['code_digest'][:12]}"
    if job.get("restarts"):
        line += f"; {job['restarts']} restart(s) after failures of the job's code"
    return line


def _stall_lines(s: dict[str, Any] | None) -> list[str]:
    if s is None:
        return ["stalls: unknown (no stall watcher report)"]
    lines = []
    cur = s["current"]
    if cur is not None:
        acts = ", ".join(cur["actions"]) or "none yet"
        lines.append(
            f"STALLED: no step for {s['stalled_for_s']:.0f} s ({cur['cause']}), "
            f"{cur['billed_nodes']} node(s) billed; recovery: {acts}"
        )
    if s["stalls"]:
        line = f"stalls: {s['stalls']} so far, {s['stalled_node_seconds'] / 3600:.2f} node-h billed without a step"
        last = s["last"]
        if last is not None and last["duration_s"] is not None:
            line += (
                f"; last: {last['cause']}, no step for {last['duration_s']:.0f} s,"
                f" training {last['recovery_s']:.0f} s after detection"
            )
        lines.append(line)
    elif cur is None:
        lines.append(f"stalls: none (a stall is {s['stall_after_s']:g} s without a step while billed)")
    return lines


def _nodes_from_db(db: Path) -> list[dict[str, Any]]:
    # Read-only: status must never take a write lock the daemon would wait on.
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        rows = conn.execute(
            "SELECT instance_id, pool, market, price_per_hour, ec2_state, launched_at, notice_at"
            " FROM instances WHERE ended_at IS NULL ORDER BY instance_id"
        ).fetchall()
    finally:
        conn.close()
    return [
        {
            "instance_id": r[0],
            "pool": r[1],
            "market": r[2],
            "price_per_hour": r[3],
            "state": "unknown",
            "ec2_state": r[4],
            "launched_at": r[5],
            "notice_at": r[6],
            "gpu_util_pct": None,
            "steps_per_s": None,
            "step": None,
            "last_checkpoint_step": None,
            "last_checkpoint_at": None,
        }
        for r in rows
    ]


def _tally(values: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


# ------------------------------------------------------------------ rendering
def _fmt(value: Any, spec: str = "", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def budget_bar(spent: float, total: float, width: int = BAR_WIDTH) -> str:
    share = 0.0 if total <= 0 else min(max(spent / total, 0.0), 1.0)
    filled = round(share * width)
    return f"[{'#' * filled}{'-' * (width - filled)}] {share * 100:.0f}%"


def render(report: dict[str, Any]) -> str:
    lines = []
    head = f"fleet {report['fleet'] or '?'}: {report['node_count']} live node(s)"
    if report["target_nodes"] is not None:
        head += f", target {report['target_nodes']}"
    if report["source"] == "snapshot":
        head += f"; as of {report['age_s']:.0f} s ago (pass every {report['reconcile_interval_s']:g} s)"
    else:
        head += "; from fleetd.db (no snapshot yet: no telemetry or budget)"
    lines.append(head)
    lines.append(_job_line(report.get("job")))
    if report.get("team") is not None:
        lines.append(_team_line(report["team"]))
    if report["stale"]:
        lines.append(f"STALE: no reconcile pass for {report['age_s']:.0f} s; is fleetd running?")
    columns = ("INSTANCE", "POOL", "MARKET", "$/H", "STATE", "EC2", "GPU%", "STEP/S", "STEP", "LAST CKPT")
    rows = [columns]
    for n in report["nodes"]:
        rows.append(
            (
                n["instance_id"],
                n["pool"],
                n["market"],
                _fmt(n["price_per_hour"], ".4f"),
                n["state"],
                n["ec2_state"],
                _fmt(n["gpu_util_pct"], ".0f"),
                _fmt(n["steps_per_s"], ".2f"),
                _fmt(n["step"]),
                _fmt(n["last_checkpoint_step"]),
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(columns))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    pools = report.get("pools")
    if pools:
        excluded = [p for p in pools if not p["offered"]]
        lines.append(f"pools: {len(pools) - len(excluded)} offered, {len(excluded)} excluded")
        lines += [f"  excluded {p['pool']}: {p['reason']}" for p in excluded]
    elif pools is None or report["source"] != "snapshot":
        lines.append("pools: unknown")
    flagged = [n for n in report["nodes"] if n.get("flag")]
    for n in flagged:
        lines.append(f"{n['instance_id']}: {n['flag']}")
    rdzv = report["rendezvous"]
    lines.append(
        f"rendezvous: round {rdzv['round']}, world size {rdzv['world_size']}" if rdzv else "rendezvous: unknown"
    )
    lines += _stall_lines(report.get("stall"))
    ckpt = report["checkpoint"]
    lines.append(
        f"durable checkpoint: step {ckpt['step']}, {ckpt['age_s']:.0f} s old"
        if ckpt
        else "durable checkpoint: none yet"
    )
    b = report["budget"]
    if b is None:
        lines.append("budget: unknown")
    else:
        lines.append(
            f"budget: {budget_bar(b['spent_usd'], b['total_usd'])} ${b['spent_usd']:.2f} of ${b['total_usd']:.2f}"
            f" spent, ${b['left_usd']:.2f} left, level {b['level']}"
        )
        to_cap = "no spend" if b["hours_to_cap"] is None else f"cap in {b['hours_to_cap']:.1f} h at this rate"
        lines.append(
            f"        burn ${b['burn_usd_per_hour']:.2f}/h (cap ${b['max_usd_per_hour']:.2f}/h),"
            f" forecast ${b['forecast_usd']:.2f}, {to_cap}"
        )
        if b["reason"]:
            lines.append(f"        {b['reason']}")
    return "\n".join(lines)
