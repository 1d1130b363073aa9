"""How the demo's job ended, for the report: its final state (from fleetd's own status, the one an
operator reads), its last step, and how long billing went on after it.

``billing_stopped_after_s``: from the job's last completed step to the moment the last node's
process tree was gone after EC2 ended it (an upper bound on its bill: EC2 stops billing at
shutting-down, a moment earlier). For code that reports no steps (folder mode) it counts from
the moment fleetd saw the job end instead, and ``billing_reference`` says so. None while any node
still runs: unknown, never a guess."""

from __future__ import annotations

from typing import Any

from fleetd.demo.progress import Progress


def job_section(run: Any, progress: Progress) -> dict[str, Any]:
    from fleetd.demo.view import status_snapshot

    snap = status_snapshot(run.workdir)
    job = snap.job if snap is not None else None
    steps = [r["t"] for r in progress.records if r["ev"] == "step"]
    reference = "last step" if steps else "job end seen by fleetd (the job's code reports no steps)"
    last_step_at = max(steps) if steps else (job.ended_at if job is not None else None)
    nodes = list(run.launcher.nodes.values()) if run.launcher is not None else []
    billing_after = None
    if nodes and all(n.stopped_at is not None for n in nodes) and last_step_at is not None:
        if run.training_since_loop is not None and run.training_since is not None:
            to_wall = run.training_since - run.training_since_loop  # the launcher keeps loop time
            last_gone = max(n.stopped_at for n in nodes) + to_wall
            billing_after = round(last_gone - last_step_at, 1)
    return {
        "job_state": str(job.state) if job is not None else "unknown",
        "job_reason": job.reason if job is not None else "",
        "job_restarts": job.restarts if job is not None else None,
        "job_final_step": job.final_step if job is not None else None,
        "billing_stopped_after_s": billing_after,
        "billing_reference": reference,
        "job_code_digest": (job.code_digest or None) if job is not None else None,
    }


def job_rows(report: dict[str, Any]) -> list[tuple[str, object]]:
    state = report.get("job_state", "unknown")
    reason = report.get("job_reason") or ""
    after = report.get("billing_stopped_after_s")
    digest = report.get("job_code_digest")
    return [
        ("job", f"{state}" + (f" ({reason})" if reason else "")),
        ("job code", f"version {digest[:12]}, shipped to the nodes" if digest else "baked into the node image"),
        (
            "billing stopped",
            f"{after:.1f} s after the {report.get('billing_reference', 'last step')}"
            if after is not None
            else "unknown (a node was still running, or no step and no job end was seen)",
        ),
    ]
