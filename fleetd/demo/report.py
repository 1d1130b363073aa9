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
from fleetd.demo.job_end import job_rows, job_section
from fleetd.demo.progress import Progress


async def _fleetd_report(workdir: Path) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fleetd.cli",
        "report",
        "--json",
        "--config",
        str(workdir / "fleetd.toml"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        return {"error": err.decode(errors="replace").strip()}
    report: dict[str, Any] = json.loads(out)
    return report


def _status_spend(workdir: Path) -> float | None:
    """What `fleetd status` (and /metrics, which follows the same snapshot) says was spent."""
    from fleetd.demo.view import status_snapshot

    snap = status_snapshot(workdir)
    return snap.budget.spent_usd if snap is not None and snap.budget is not None else None


def _decisions(money: dict[str, Any], up: bool) -> list[dict[str, Any]]:
    return [d for d in money.get("scaling_decisions") or [] if (d["to"] > d["from"]) == up and d["to"] != d["from"]]


async def durable_steps(session: Any, aws: dict[str, Any], prefix: str = "") -> list[int]:
    """Every step whose manifest is in the demo's bucket (under ``prefix``): the durable ones."""
    steps = []
    async with session.create_client("s3", **aws) as s3:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=configs.DEMO_BUCKET, Prefix=prefix)
        async for page in pages:
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if key.endswith("/MANIFEST.json") and "/step-" in key:
                    steps.append(int(key.rsplit("/step-", 1)[1].split("/", 1)[0]))
    return sorted(steps)


def _notice_log(run: Any, began_wall: float | None) -> list[dict[str, Any]]:
    """Every notice the demo played, one entry each (simultaneous ones included): which node,
    when, whether it was a replacement (bought after training began), whether fleetd saw it."""
    nodes = run.launcher.nodes if run.launcher else {}
    began = run.training_since_loop if run.training_since_loop is not None else float("inf")
    seen = {iid for _, iid, kind, _ in (run.view.events if run.view else []) if kind == "notice"}
    out = []
    for at, kind, iid in run.injected:
        if kind != "notice":
            continue
        node = nodes.get(iid)
        out.append(
            {
                "instance_id": iid,
                "at_s": round(at - began_wall, 3) if began_wall is not None else None,
                "replacement": bool(node is not None and node.started_at > began),
                "seen_by_fleet": iid in seen,
            }
        )
    return out


def _whole_fleet(run: Any, progress: Progress) -> dict[str, Any] | None:
    """When every node was noticed at once: the newest checkpoint durable in S3 before the last of
    them was gone (a step trained before the replacements began: their own saves are not the
    wave's), and where their training began.

    The replacements either resume from that checkpoint once the noticed nodes are gone
    (``via``: "checkpoint"), or, when they join while noticed nodes are still inside their notice,
    train in one round with them and get the state from them ("peers": nothing had to reach S3
    first). Either way their first round starts from ``resume_step``, and what the wave cost is
    the step trained before it that this round does not carry on from."""
    waves = [at for at, kind, _ in run.injected if kind == "notice-all"]
    if not waves or run.launcher is None or run.view is None or run.training_since_loop is None:
        return None
    wave_wall = waves[-1]
    offset = run.training_since_loop - run.training_since  # wall clock -> the event loop's clock
    wave_ids = {iid for at, kind, iid in run.injected if kind == "notice" and at >= wave_wall}
    nodes = run.launcher.nodes
    stops = [n.stopped_at for iid, n in nodes.items() if iid in wave_ids]
    unknown = {
        "nodes": len(wave_ids),
        "last_left_s": None,
        "durable_step_before_last_left": None,
        "resume_step": None,
        "steps_lost": None,
        "via": None,
    }
    if not wave_ids or any(t is None for t in stops):
        return unknown
    last_left_wall = max(stops) - offset
    wave_addrs = {nodes[iid].addr for iid in wave_ids if iid in nodes}
    starts = [r for r in progress.records if r["ev"] == "start" and r["t"] > wave_wall]
    first = next((r for r in starts if r.get("node") not in wave_addrs), None)
    last_step = max(
        (r["step"] for r in progress.records if r["ev"] == "step" and r["t"] <= (first or {}).get("t", last_left_wall)),
        default=None,
    )
    # What the wave left durable: up to the last noticed node's exit, and no step past the last
    # one trained before the replacements began. A last leaver inside a long notice can outlast
    # their first round, whose own saves (a join's hold checkpoint) are theirs, not the wave's
    # (run 30 of the test suite: the replacements resumed at the wave's 1068, trained 1069 and
    # saved it for a joiner while the last noticed node still drained; 1069 was counted). By
    # step, not by time: an upload's time is when its agent reported it, a moment after S3 had it.
    durable_before = [
        step
        for step, at in run.view.durable_at.items()
        if at <= last_left_wall and (last_step is None or step <= last_step)
    ]
    resume_step = int(first.get("from_step", 0)) if first is not None else None
    # The round the replacements first trained in: every start within a moment of the first.
    round_nodes = {r.get("node") for r in starts if first is not None and abs(r["t"] - first["t"]) < 2.0}
    return {
        **unknown,
        "noticed_at_s": round(wave_wall - run.training_since, 2),
        "last_left_s": round(last_left_wall - run.training_since, 2),
        "last_step_before": last_step,
        "durable_step_before_last_left": max(durable_before) if durable_before else None,
        "resume_step": resume_step,
        "steps_lost": (max(0, last_step - resume_step) if last_step is not None and resume_step is not None else None),
        "via": None if first is None else ("peers" if round_nodes & wave_addrs else "checkpoint"),
    }


async def build_report(run: Any, events_file: Path, ec2: Any, session: Any, aws: dict[str, Any]) -> dict[str, Any]:
    progress = Progress.load(events_file)
    restarts = progress.restarts()
    money = await _fleetd_report(run.workdir)
    durable = await durable_steps(session, aws)
    nodes = list(run.launcher.nodes.values()) if run.launcher else []
    launched = len(nodes)
    # Replacements: instances bought after training began (the initial wave is not one).
    began = run.training_since_loop if run.training_since_loop is not None else float("inf")
    replacements = sum(1 for n in nodes if n.started_at > began)
    pauses = []
    for r in restarts:
        back = progress.training_again_at(r.at, r.world)
        last_before = max(
            (rec["t"] for rec in progress.records if rec["ev"] == "step" and rec["t"] < r.at), default=None
        )
        if back is not None and last_before is not None:
            pauses.append(round(back - last_before, 2))
    injected = [kind for _, kind, _ in run.injected]
    from fleetd.demo.stalls import stall_report

    sup = getattr(run, "rendezvous", None)
    stall = stall_report(
        progress, run.workdir, sup.restarts if sup is not None else [], billed_nodes=run.opts.nodes, since=None
    )  # every step is after training began
    notice_log = _notice_log(run, run.training_since)
    reports_steps = any(rec["ev"] == "step" for rec in progress.records)
    return {
        "scenario": run.opts.scenario.name if run.opts.scenario else "calm",
        "duration_s": round(time.time() - run.started_at, 1),
        "notices": injected.count("notice"),
        # Distinct notices the fleet saw: an agent repeats its notice every 10 s until it is
        # gone (agent/node/notice_repeat.py), so counting messages said "2 injected / 3 seen".
        "notices_seen_by_fleet": sum(1 for n in notice_log if n["seen_by_fleet"]),
        "notice_messages": run.view.kinds.get("notice", 0) if run.view else 0,
        "notice_log": notice_log,
        "whole_fleet_notice": _whole_fleet(run, progress),
        "losses_without_notice": injected.count("vanish"),
        "rebalance_recommendations": injected.count("rebalance"),
        "capacity_errors_injected": injected.count("capacity-error"),
        # Rolled back; a stall's time is in "stall". Unknown for code that reports no step
        # (folder mode: a plain script fleetd only sees save files of).
        "steps_lost": sum(r.steps_lost for r in restarts) if reports_steps else None,
        "stall": stall,
        "replacements": replacements,
        "instances_launched": launched,
        # Measured from the steps the job reports: unknown (None) for code that reports none.
        "max_world_size": progress.max_world_size if reports_steps else None,
        "final_step": progress.final_step if reports_steps else None,
        "world_changes": len(restarts) if reports_steps else None,
        "resume_latency_s": pauses if reports_steps else None,
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
        # The demo ended when its scripted story was told, before --duration (fleetd/demo/story.py).
        "story_told": run.story_told,
        **job_section(run, progress),
        "failure": run.failure,
        "ledger": money,
        "workdir": str(run.workdir),
    }


NO_STEPS = "unknown (the job's code reports no steps)"


def _steps_lost(report: dict[str, Any]) -> str:
    """Never "0" for a run that stalled: the stall's steps were not trained either."""
    rolled_back = report["steps_lost"]
    if rolled_back is None:
        return "unknown (the job's code reports no steps: folder mode)"
    gaps = (report.get("stall") or {}).get("measured") or []
    if not gaps:
        return str(rolled_back)
    forgone = [g["steps_not_trained"] for g in gaps]
    extra = "unknown" if any(f is None for f in forgone) else f"~{sum(forgone)}"
    return f"{rolled_back} rolled back + {extra} not trained while stalled"


def _stalls(stall: dict[str, Any] | None) -> str:
    if not stall or not stall.get("measured"):
        return "none"
    parts = []
    for g in stall["measured"]:
        back = g["store_back_to_training_s"]
        parts.append(
            f"{g['no_step_s']:.0f} s"
            + (f" (training {back:.1f} s after the store was back)" if back is not None else "")
        )
    return "; ".join(parts) + f"; {stall['stalled_node_seconds_measured']:.0f} node-s billed"


def render(report: dict[str, Any]) -> str:
    rows: list[tuple[str, object]] = [
        *job_rows(report),
        (
            "notices (injected / seen)",
            f"{report['notices']} / {report['notices_seen_by_fleet']}"
            f" ({report.get('notice_messages', 0)} notice messages, repeats included)",
        ),
        (
            "notices per node",
            "; ".join(
                f"{n['instance_id']} @{n['at_s']}s{' (replacement)' if n['replacement'] else ''}"
                f"{'' if n['seen_by_fleet'] else ' NOT SEEN'}"
                for n in report.get("notice_log", [])
            )
            or "-",
        ),
        ("losses without notice", report.get("losses_without_notice", 0)),
        ("steps lost", _steps_lost(report)),
        ("stalls (no step >= 10 s)", _stalls(report.get("stall")) if report["steps_lost"] is not None else NO_STEPS),
        ("replacements", report["replacements"]),
        ("max world size", NO_STEPS if report["max_world_size"] is None else report["max_world_size"]),
        ("final step", NO_STEPS if report["final_step"] is None else report["final_step"]),
        (
            "pause per world change (s)",
            NO_STEPS
            if report["resume_latency_s"] is None
            else ", ".join(str(x) for x in report["resume_latency_s"]) or "-",
        ),
        ("durable checkpoints", report["checkpoints_durable"]),
        ("scale-ups / scale-downs", f"{len(report.get('scale_ups') or [])} / {len(report.get('scale_downs') or [])}"),
        ("spend", f"${report['spend_usd']:.4f}" if report["spend_usd"] is not None else "unknown"),
        ("budget", f"${report['budget_usd']:.2f}"),
        (
            "on-demand equivalent",
            f"${report['on_demand_equivalent_usd']:.4f}"
            if report["on_demand_equivalent_usd"] is not None
            else "unknown",
        ),
        ("savings", f"{report['savings_pct']:.1f} %" if report["savings_pct"] is not None else "unknown"),
    ]
    wipe = report.get("whole_fleet_notice")
    if wipe:
        rows += [
            (
                "whole fleet noticed",
                f"{wipe['nodes']} nodes at {wipe.get('noticed_at_s')} s, last gone at {wipe['last_left_s']} s",
            ),
            ("durable before last left", wipe["durable_step_before_last_left"]),
            ("replacements began at step", f"{wipe['resume_step']} (from {wipe.get('via') or 'unknown'})"),
            ("steps lost (whole fleet)", wipe["steps_lost"]),
        ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for kind in ("scale_ups", "scale_downs"):
        for d in report.get(kind) or []:
            lines.append(f"  {d['from']} -> {d['to']}: {d['reason']}")
    return "\n".join(lines)
