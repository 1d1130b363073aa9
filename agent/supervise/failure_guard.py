"""While torchrun runs, read its log as it grows and end it on a failure of the job's own code
(agent/supervise/worker_failures.py says which failures those are, and why torchrun's own
restarts must not retry them)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

from agent.supervise.torchrun import TorchrunExit, TorchrunProcess
from agent.supervise.worker_failures import FailureScanner
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

# Well inside one of torchrun's own restarts (a warm-pool worker re-runs ~0.4 s after it fails):
# at 1 s a bug ran two or three times per attempt before the guard read its first failure.
POLL_S = 0.1
READ_MAX = 256 * 1024


def _read_from(path: Path, offset: int) -> tuple[str, int]:
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < offset:
                offset = 0  # rotated (agent/supervise/worker_output.py): the new file from its top
            f.seek(offset)
            data = f.read(READ_MAX)
    except OSError:
        return "", offset
    return data.decode(errors="replace"), offset + len(data)


async def wait_guarded(
    torchrun: TorchrunProcess, log_path: Path | None, since: int, may_act: Callable[[], bool]
) -> TorchrunExit:
    """``torchrun.wait()``, ending it early when its log shows the job's code failing.
    ``may_act``: False while a drain or stop is under way (their SIGTERMs are not failures)."""
    if log_path is None:
        return await torchrun.wait()
    waiting = asyncio.ensure_future(torchrun.wait())
    scanner = FailureScanner()
    offset = since
    try:
        while not waiting.done():
            await asyncio.wait({waiting}, timeout=POLL_S)
            text, offset = await asyncio.to_thread(_read_from, log_path, offset)
            failure = scanner.feed(text) if text else None
            if failure is not None and may_act() and not torchrun.stopping and not waiting.done():
                log.error(
                    "trainer_user_failure",
                    exit_code=failure.exit_code,
                    local_rank=failure.local_rank,
                    why="the job's code failed (no network fault in its output): ending torchrun's restarts",
                    excerpt=failure.excerpt[-400:],
                )
                await asyncio.to_thread(torchrun.fail, failure.exit_code)
        return await waiting
    finally:
        if not waiting.done():
            waiting.cancel()
