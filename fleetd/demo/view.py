"""The demo's live terminal view: nodes, rendezvous world, budget, and events as they happen.

On a terminal the screen is redrawn in place about once a second; otherwise (CI, a pipe) a
one-line summary is printed every few seconds so logs stay readable.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from fleetd.demo.progress import Progress
from fleetd.protocol.errors import ProtocolError
from fleetd.snapshot import StatusSnapshot, read_snapshot


def status_snapshot(workdir: Path) -> StatusSnapshot | None:
    """fleetd's last per-pass snapshot of the demo fleet (None until the first pass)."""
    try:
        return read_snapshot(workdir / "state")
    except (OSError, ProtocolError):
        return None  # mid-write or not written yet: the next frame will have it


def render(run: Any, progress: Progress) -> str:
    view, launcher = run.view, run.launcher
    now = time.time()
    elapsed = now - run.started_at
    snap = status_snapshot(run.workdir)
    # The job's code may report no step (folder mode): then the step is unknown, not 0.
    reported = progress.final_step > 0 or any(r["ev"] == "step" for r in progress.records[-50:])
    stepping = f"step {progress.final_step} · world {_world(progress)}" if reported else _job_line(snap)
    lines = [f"fleetd demo · {run.opts.scenario.name if run.opts.scenario else 'calm'} · {elapsed:5.0f} s · {stepping}"]
    if snap is not None and snap.budget is not None:
        b = snap.budget
        filled = int(20 * min(1.0, b.spent_usd / b.total_usd)) if b.total_usd else 0
        lines.append(
            f"budget [{'#' * filled}{'.' * (20 - filled)}] ${b.spent_usd:.4f} of ${b.total_usd:.2f}"
            f"  forecast ${b.forecast_usd:.4f} ({b.level})"
        )
    if snap is not None and snap.rendezvous is not None:
        lines.append(f"rendezvous round {snap.rendezvous.round}, world size {snap.rendezvous.world_size}")
    lines.append(f"{'instance':<22}{'pool':<24}{'market':<10}{'state':<10}{'step':>8}{'steps/s':>9}")
    for node in sorted(launcher.nodes.values(), key=lambda n: n.started_at) if launcher else []:
        tel = view.telemetry.get(node.instance_id) if view else None
        state = "gone" if node.stopped_at else (view.status.get(node.instance_id, "booting") if view else "?")
        sps = f"{tel.steps_per_s:.1f}" if tel and tel.steps_per_s is not None else "-"
        step = str(tel.step) if tel and tel.step is not None else "-"
        lines.append(
            f"{node.instance_id:<22}{node.instance_type + '@' + node.zone:<24}{node.lifecycle:<10}"
            f"{state:<10}{step:>8}{sps:>9}"
        )
    lines.append("events:")
    recent = sorted(
        [(t, f"{kind:<15} {target}") for t, kind, target in run.injected]
        + [
            (time.time() - (asyncio.get_running_loop().time() - t), f"{kind:<15} {iid} {detail}")
            for t, iid, kind, detail in (view.events if view else [])
        ]
    )[-8:]
    lines += [f"  {t - run.started_at:6.1f}s  {text}" for t, text in recent]
    return "\n".join(lines)


def _job_line(snap: StatusSnapshot | None) -> str:
    job = snap.job if snap is not None else None
    world = snap.rendezvous.world_size if snap is not None and snap.rendezvous is not None else None
    return f"step unknown (no step reported) · job {job.state if job else 'unknown'} · world {world if world is not None else 'unknown'}"


def _world(progress: Progress) -> int:
    recent = [r for r in progress.records[-50:] if r["ev"] == "step"]
    return recent[-1].get("world", 0) if recent else 0


async def render_loop(run: Any, events_file: Path) -> None:
    if not run.opts.live_view:
        return
    tty = sys.stdout.isatty()
    period = 1.0 if tty else 10.0
    while True:
        await asyncio.sleep(period)
        text = render(run, Progress.load(events_file))
        if tty:
            sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")
        else:
            sys.stdout.write(text.splitlines()[0] + "\n")
        sys.stdout.flush()
