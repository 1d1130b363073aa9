"""The demo's closing report: fleetd's own cost/goodput ledger plus what the demo observed.

Money comes from ``fleetd report --json`` (the controller's persisted ledger, the same numbers an
operator gets); training facts come from the trainers' event trace; durability from S3 itself
(a checkpoint counts only once its manifest is there).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from fleetd.demo import configs
from fleetd.demo.progress import Progress


async def _fleetd_report(workdir: Path) -> dict:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetd.cli", "report", "--json", "--config", str(workdir / "fleetd.toml"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        return {"error": err.decode(errors="replace").strip()}
    return json.loads(out)


def _status_spend(workdir: Path) -> float | None:
    """What `fleetd status` (and /metrics, which follows the same snapshot) says was spent."""
    from fleetd.demo.view import status_snapshot

    snap = status_snapshot(workdir)
    return snap.budget.spent_usd if snap is not None and snap.budget is not None else None


def _decisions(money: dict, up: bool) -> list[dict]:
    return [d for d in money.get("scaling_decisions") or [] if (d["to"] > d["from"]) == up and d["to"] != d["from"]]


async def _durable_steps(session: Any, aws: dict) -> list[int]:
    steps = []
    async with session.create_client("s3", **aws) as s3:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=configs.DEMO_BUCKET)
        async for page in pages:
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if key.endswith("/MANIFEST.json") and "/step-" in key:
                    steps.append(int(key.rsplit("/step-", 1)[1].split("/", 1)[0]))
    return sorted(steps)


async def build_report(run: Any, events_file: Path, ec2: Any, session: Any, aws: dict) -> dict:
    progress = Progress.load(events_file)
    restarts = progress.restarts()
    money = await _fleetd_report(run.workdir)
    durable = await _durable_steps(session, aws)
    nodes = list(run.launcher.nodes.values()) if run.launcher else []
    launched = len(nodes)
    # Replacements: instances bought after training began (the initial wave is not one).
    began = run.training_since_loop if run.training_since_loop is not None else float("inf")
    replacements = sum(1 for n in nodes if n.started_at > began)
    pauses = []
    for r in restarts:
        back = progress.training_again_at(r.at, r.world)
        last_before = max((rec["t"] for rec in progress.records if rec["ev"] == "step" and rec["t"] < r.at),
                          default=None)
        if back is not None and last_before is not None:
            pauses.append(round(back - last_before, 2))
    injected = [kind for _, kind, _ in run.injected]
    return {
        "scenario": run.opts.scenario.name if run.opts.scenario else "calm",
        "duration_s": round(time.time() - run.started_at, 1),
        "notices": injected.count("notice"),
        "notices_seen_by_fleet": run.view.kinds.get("notice", 0) if run.view else 0,
        "losses_without_notice": injected.count("vanish"),
        "rebalance_recommendations": injected.count("rebalance"),
        "capacity_errors_injected": injected.count("capacity-error"),
        "steps_lost": sum(r.steps_lost for r in restarts),
        "replacements": replacements,
        "instances_launched": launched,
        "max_world_size": progress.max_world_size,
        "final_step": progress.final_step,
        "world_changes": len(restarts),
        "resume_latency_s": pauses,
        "checkpoints_durable": len(durable),
        "newest_durable_step": durable[-1] if durable else None,
        "spend_usd": money.get("spend_usd"),
        "status_spend_usd": _status_spend(run.workdir),
        "useful_steps": money.get("useful_steps"),
        "scale_ups": _decisions(money, up=True),
        "scale_downs": _decisions(money, up=False),
        "budget_usd": run.opts.budget_usd,
        "on_demand_equivalent_usd": money.get("on_demand_equivalent_usd"),
        "savings_pct": money.get("savings_pct"),
        "stopped_by_budget": run.stopped_by_budget,
        "failure": run.failure,
        "ledger": money,
        "workdir": str(run.workdir),
    }


def render(report: dict) -> str:
    rows = [
        ("notices (injected / seen)", f"{report['notices']} / {report['notices_seen_by_fleet']}"),
        ("losses without notice", report.get("losses_without_notice", 0)),
        ("steps lost", report["steps_lost"]),
        ("replacements", report["replacements"]),
        ("max world size", report["max_world_size"]),
        ("final step", report["final_step"]),
        ("pause per world change (s)", ", ".join(str(x) for x in report["resume_latency_s"]) or "-"),
        ("durable checkpoints", report["checkpoints_durable"]),
        ("scale-ups / scale-downs", f"{len(report.get('scale_ups') or [])} / {len(report.get('scale_downs') or [])}"),
        ("spend", f"${report['spend_usd']:.4f}" if report["spend_usd"] is not None else "unknown"),
        ("budget", f"${report['budget_usd']:.2f}"),
        ("on-demand equivalent", f"${report['on_demand_equivalent_usd']:.4f}"
         if report["on_demand_equivalent_usd"] is not None else "unknown"),
        ("savings", f"{report['savings_pct']:.1f} %" if report["savings_pct"] is not None else "unknown"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for kind in ("scale_ups", "scale_downs"):
        for d in report.get(kind) or []:
            lines.append(f"  {d['from']} -> {d['to']}: {d['reason']}")
    return "\n".join(lines)
