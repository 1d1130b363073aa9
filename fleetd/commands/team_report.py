"""`fleetd team report [--json]`: what the team's jobs cost and trained, each from its own ledger
(the numbers `fleetd report` gives for the job), and the team's totals against its budget: spend,
its on-demand equivalent, useful steps, steps lost and $ per 1k useful steps; where each job runs,
and the moves the team made. A job whose ledger cannot be read says why and makes the team's
spend a lower bound ("or more"), never a smaller number passed off as the total."""

from __future__ import annotations

from typing import Any

from fleetd.team.config import TeamConfig

_COLUMNS = ("spend_usd", "on_demand_equivalent_usd", "useful_steps", "steps_lost", "usd_per_1k_steps", "savings_pct")


def team_report(cfg: TeamConfig, now: float) -> dict[str, Any]:
    from fleetd.commands.report import LedgerUnreadable, ledger_of
    from fleetd.policy import ledger
    from fleetd.protocol.errors import ProtocolError
    from fleetd.team.arbiter import read_job
    from fleetd.team.region_file import read_region

    jobs: list[dict[str, Any]] = []
    for entry in cfg.jobs:
        seen = read_job(entry)
        row: dict[str, Any] = {"name": entry.name, "priority": entry.priority, "error": None}
        snap = seen.snapshot
        row["state"] = str(snap.job.state) if snap is not None and snap.job is not None else "unknown"
        if seen.cfg is None:
            row["error"] = seen.problem
            jobs.append(row)
            continue
        row["region"] = seen.cfg.aws.region
        try:
            moved = read_region(seen.cfg.fleet.state_dir)
        except ProtocolError as exc:
            row["error"] = f"its region record cannot be read: {exc}"
            jobs.append(row)
            continue
        row["moved"] = moved.model_dump(exclude={"schema_version"}) if moved is not None else None
        try:
            events, seen_at = ledger_of(seen.cfg)
        except LedgerUnreadable as exc:
            row["error"] = str(exc)
            jobs.append(row)
            continue
        summary = ledger.summarize(events, now, seen_at).as_json()
        row.update({k: summary[k] for k in _COLUMNS})
        jobs.append(row)
    read = [j for j in jobs if j["error"] is None]
    spend = sum(j["spend_usd"] for j in read)
    useful = sum(j["useful_steps"] for j in read)
    return {
        "team": cfg.team.name,
        "team_budget_usd": cfg.team.total_usd,
        "team_spend_usd": round(spend, 6),
        "spend_is_lower_bound": len(read) < len(jobs),
        "team_on_demand_equivalent_usd": round(sum(j["on_demand_equivalent_usd"] for j in read), 6),
        "team_useful_steps": useful,
        "team_steps_lost": sum(j["steps_lost"] for j in read),
        # Unknown, not zero, when nothing trained (or a job could not be read).
        "team_usd_per_1k_steps": round(1000 * spend / useful, 6) if useful and len(read) == len(jobs) else None,
        "region_moves": [{"job": j["name"], **j["moved"]} for j in read if j.get("moved")],
        "jobs": jobs,
    }


def render_team_report(r: dict[str, Any]) -> str:
    more = " or more (a ledger could not be read)" if r["spend_is_lower_bound"] else ""
    per_1k = "unknown" if r["team_usd_per_1k_steps"] is None else f"${r['team_usd_per_1k_steps']:.4f}"
    lines = [
        f"team {r['team']}: spent ${r['team_spend_usd']:.4f}{more} of ${r['team_budget_usd']:.2f} "
        f"(on-demand equivalent ${r['team_on_demand_equivalent_usd']:.4f}); {r['team_useful_steps']} useful "
        f"steps, {r['team_steps_lost']} lost; {per_1k} per 1k useful steps",
        f"{'job':<16} {'prio':>4} {'state':<11} {'region':<12} {'spend $':>9} {'steps':>9} {'lost':>6} {'$/1k':>8}",
    ]
    for j in r["jobs"]:
        if j["error"] is not None:
            lines.append(f"{j['name']:<16} {j['priority']:>4} {j['state']:<11} unreadable: {j['error']}")
            continue
        per = "unknown" if j["usd_per_1k_steps"] is None else f"{j['usd_per_1k_steps']:.4f}"
        lines.append(
            f"{j['name']:<16} {j['priority']:>4} {j['state']:<11} {j['region']:<12} {j['spend_usd']:>9.4f} "
            f"{j['useful_steps']:>9} {j['steps_lost']:>6} {per:>8}"
        )
    for m in r["region_moves"]:
        lines.append(f"moved: {m['job']} {m['moved_from']} -> {m['region']} ({m['objects']} objects copied)")
    return "\n".join(lines)
