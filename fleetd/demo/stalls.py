"""What the demo measured about stalls: time without a step while nodes were billed.

Two sources that do not depend on each other: the trainers' own step trace (the time between the
last step before a gap and the first after it) and fleetd's stall watcher (``stalls.json``,
what an operator would see). The rendezvous host's restarts (the demo's supervisor restarts it
like systemd) give the moment the store was back, so a store outage's recovery time is
"store back -> first step", the number issue 14 targets (<= 15 s).
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

from fleetd.demo.progress import Progress

GAP_S = 10.0  # a pause shorter than this is a re-form, not a stall worth a line


def host_ready_times(log: Path) -> list[float]:
    """Epoch seconds at which ``fleetd rendezvous`` was serving (one per life)."""
    from datetime import datetime

    out = []
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        if '"rendezvous_host_ready"' not in line:
            continue
        try:
            out.append(datetime.fromisoformat(json.loads(line)["timestamp"].replace("Z", "+00:00")).timestamp())
        except (ValueError, KeyError):
            continue
    return sorted(out)


def measured_gaps(progress: Progress, since: float | None, gap_s: float = GAP_S) -> list[dict[str, Any]]:
    steps = [r for r in progress.records if r["ev"] == "step" and (since is None or r["t"] >= since)]
    gaps = []
    for prev, nxt in pairwise(steps):
        if nxt["t"] - prev["t"] > gap_s:
            gaps.append(
                {
                    "last_step_at": prev["t"],
                    "last_step": prev["step"],
                    "next_step_at": nxt["t"],
                    "next_step": nxt["step"],
                    "no_step_s": round(nxt["t"] - prev["t"], 2),
                }
            )
    return gaps


def stall_report(
    progress: Progress, workdir: Path, restarts: list[tuple[float, int | None]], billed_nodes: int, since: float | None
) -> dict[str, Any]:
    from fleetd.stall_record import read_stalls

    ready = host_ready_times(workdir / "rendezvous.log")
    gaps = measured_gaps(progress, since)
    rate = _rate_before(progress, gaps[0]["last_step_at"]) if gaps else None
    for g in gaps:
        back = [t for t in ready[1:] if g["last_step_at"] <= t <= g["next_step_at"]]
        g["store_back_at"] = back[-1] if back else None
        # The target: store back -> training again.
        g["store_back_to_training_s"] = round(g["next_step_at"] - back[-1], 2) if back else None
        g["steps_not_trained"] = None if rate is None else round(g["no_step_s"] * rate)
    err: str | None
    try:
        record = read_stalls(workdir / "state")
    except Exception as exc:  # noqa: BLE001 - report what we have
        record, err = None, str(exc)
    else:
        err = None
    fleetd_view = None if record is None else record.model_dump()
    longest = max((g["no_step_s"] for g in gaps), default=0.0)
    return {
        "store_restarts": len(restarts),
        "measured": gaps,  # from the trainers' step trace
        "longest_no_step_s": longest,
        "stall_duration_s": gaps[0]["no_step_s"] if gaps else None,
        "stall_recovery_s": gaps[0]["store_back_to_training_s"] if gaps else None,
        "stalled_node_seconds_measured": round(sum(g["no_step_s"] for g in gaps) * billed_nodes, 1),
        "fleetd": fleetd_view,  # what fleetd's stall watcher detected (stalls.json)
        "fleetd_error": err,
    }


def _rate_before(progress: Progress, t: float, window_s: float = 30.0) -> float | None:
    steps = [r["step"] for r in progress.records if r["ev"] == "step" and t - window_s <= r["t"] <= t]
    if len(steps) < 2:
        return None
    rate: float = (max(steps) - min(steps)) / window_s
    return rate
