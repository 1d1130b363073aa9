"""`fleetd team run|plan|status [--config /etc/fleetd/team.toml]`: one budget over several jobs.

- ``run``: the team's planning loop (systemd/fleetd-team.service): every ``team.interval_s`` it
  reads each job's status and writes each job's allotment, which the job's own daemon plans inside.
- ``plan``: one pass, printed, nothing written: what the team would allot now, and why.
- ``status``: the allotments in force, each job's spend and nodes, and the team's total.
- ``report``: each job's spend and training from its ledger, the team's totals and moves
  (fleetd/commands/team_report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from fleetd.team.config import DEFAULT_TEAM_PATH


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("run", "plan", "status", "report"))
    p.add_argument("--config", type=Path, default=DEFAULT_TEAM_PATH, help="the team's config (%(default)s)")
    p.add_argument("--json", action="store_true", help="plan, status, report: print JSON")


def run(args: argparse.Namespace) -> int:
    from fleetd.shared.logs import bind_context, configure_logging
    from fleetd.shared.settings import ConfigError
    from fleetd.team.config import load_team

    try:
        cfg = load_team(args.config)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return 2
    if args.action == "run":
        from fleetd.team.arbiter import run_team

        configure_logging(cfg.logging.level, json=cfg.logging.json_lines)
        bind_context(team=cfg.team.name, component="fleetd-team")
        asyncio.run(run_team(cfg))
        return 0
    if args.action == "report":
        from fleetd.commands.team_report import render_team_report, team_report

        spent = team_report(cfg, time.time())
        print(json.dumps(spent, indent=2, sort_keys=True) if args.json else render_team_report(spent))
        return 0
    report = asyncio.run(_report(cfg, write=False))
    print(json.dumps(report, indent=2, sort_keys=True) if args.json else render(report, args.action))
    return 0


async def _report(cfg: Any, *, write: bool) -> dict[str, Any]:
    from fleetd.team.arbiter import team_pass

    done = await team_pass(cfg, time.time(), dry_run=not write)
    rows = []
    new = {r.job: r for r in done.written}
    for s in done.seen:
        name = s.entry.name
        live = [n for n in s.snapshot.live_nodes] if s.snapshot is not None else []
        current = s.previous
        rows.append(
            {
                "name": name,
                "priority": s.entry.priority,
                "state": str(s.snapshot.job.state) if s.snapshot and s.snapshot.job else "unknown",
                "nodes": len(live) if s.snapshot is not None else None,
                "spend_usd": None if s.entry.name in done.spend_unknown else round(s.spent_usd, 4),
                "allotment": current.model_dump(exclude={"schema_version", "team", "job"}) if current else None,
                "next": new[name].model_dump(exclude={"schema_version", "team", "job"}) if name in new else None,
                "skipped": done.skipped.get(name),
            }
        )
    return {
        "team": cfg.team.name,
        "team_budget_usd": cfg.team.total_usd,
        "team_max_usd_per_hour": cfg.team.max_usd_per_hour,
        "team_spend_usd": round(done.spent_usd, 4),
        "spend_unknown": list(done.spend_unknown),  # team_spend_usd is then a lower bound
        "room_usd_per_hour": round(done.plan.room_usd_per_hour, 4) if done.plan else None,
        "jobs": rows,
    }


def render(report: dict[str, Any], action: str) -> str:
    which = "next" if action == "plan" else "allotment"
    unknown = report["spend_unknown"]
    spent = f"spent ${report['team_spend_usd']:.2f}" + (
        f" or more ({', '.join(unknown)}: spend unknown)" if unknown else ""
    )
    lines = [
        f"team {report['team']}: {spent} of ${report['team_budget_usd']:.2f}, "
        f"at most ${report['team_max_usd_per_hour']:.2f}/h",
        f"{'job':<16} {'prio':>4} {'state':<11} {'nodes':>5} {'spend $':>9}  {which}",
    ]
    for j in report["jobs"]:
        a = j[which]
        said = (
            f"{a['kind']} {a['nodes']} node(s) ${a['usd_per_hour']:.2f}/h, ${a['total_usd']:.2f} in all: {a['reason']}"
            if a
            else f"none ({j['skipped'] or 'not written yet'})"
        )
        nodes = "?" if j["nodes"] is None else str(j["nodes"])
        spend = "unknown" if j["spend_usd"] is None else f"{j['spend_usd']:.2f}"
        lines.append(f"{j['name']:<16} {j['priority']:>4} {j['state']:<11} {nodes:>5} {spend:>9}  {said}")
    return "\n".join(lines)
