"""bench/gpu_check.py's ``job_workspace`` check: a user's job as a node runs it (the toy project
packed, verified, unpacked, its virtualenv made and its setup run by agent/supervise/workspace.py;
then torchrun with that virtualenv's python in the code folder, the output through the agent's
pipe, a worker SIGKILLed at step 50). On a GPU it shows the job's own environment trains on CUDA
and salvages there."""

from __future__ import annotations

import asyncio
import os
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def check_job_workspace(
    device: str, work: Path, steps: int, torchrun_check: Callable[..., dict[str, Any]]
) -> dict[str, Any]:
    """``torchrun_check``: gpu_check.check_torchrun_restart (the kill, the restart and the resume)."""
    from agent.supervise.worker_output import WorkerOutput
    from agent.supervise.workspace import JobWorkspace, prepare
    from fleetd.jobs.pack import pack

    project = ROOT / "agent" / "examples" / "toy_job"
    packed = pack(project)
    setup = tuple(tomllib.loads((project / "job.toml").read_text())["setup"])
    if device == "cuda":  # the job's own python must see the image's CUDA build of torch
        setup += ("python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)'",)
    ws = JobWorkspace(work / "ws", "s3://fleetd-checkpoints/toy/code/x.tar.gz", packed.digest, setup)

    async def fetch(bucket: str, key: str) -> bytes:
        return packed.data

    t0 = time.monotonic()
    asyncio.run(prepare(ws, fetch))
    prepare_s = time.monotonic() - t0
    lines: list[tuple[str, int | None]] = []

    class Sink:  # stands in for journald and the batcher (agent/node/log_sink.py)
        def line(self, text: str, rank: int | None = None) -> None:
            lines.append((text, rank))

    out = WorkerOutput(work / "torchrun.log", Sink())  # type: ignore[arg-type]
    # The image's fleetd (here: this checkout) for the trainer library; the job's folder first.
    env = ws.launch_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ws.code), str(ROOT), os.environ.get("PYTHONPATH", "")])
    result = torchrun_check(
        device, work, steps, module="train_toy", python=str(ws.python), cwd=ws.code, env_extra=env, output=out
    )
    drained = out.join(10)
    ranked = {r for _, r in lines if r is not None}
    return {
        **result,
        "ok": result["ok"] and drained and len(lines) > 0,
        "code_digest": packed.digest[:12],
        "files": len(packed.files),
        "prepare_s": round(prepare_s, 2),
        "setup_log_tail": ws.setup_log.read_text(errors="replace").splitlines()[-3:],
        "venv_python": str(ws.python),
        "log_lines": len(lines),
        "log_ranks": sorted(ranked),
    }
