"""How a training worker process ends: flush its output, then ``os._exit``, skipping the
interpreter's teardown.

Why: torch's distributed backends keep C++ threads alive past ``destroy_process_group()``. With
DDP, gloo's two ``pt_gloo_runloop`` threads and its ``gloo_tcp_loop`` thread are still running
after ``destroy_process_group()`` and a ``gc.collect()`` (the process group stays referenced), so
they live on into interpreter finalization. There, a C++ thread that needs the GIL is unwound by
force and the process aborts with "terminate called without an active exception" (the mechanism
pytorch#179291 describes; which thread did it here was not caught).

We saw that abort in a two-rank gloo DCP job under load: 2 of ~15 full suite runs, rank 1 right
after printing its final step. The job had finished and saved, but torchrun reported it failed.
torch's own fix, an atexit ``destroy_process_group`` (pytorch#179291), was abandoned as more
involved than it looked, and with DDP that call does not stop these threads anyway.

A worker that has saved, reported and destroyed its process group has nothing left to do in
teardown: its checkpoint and events files are written and closed as it goes. So it exits the way
the agent's warm pool ends every worker it forks (agent/supervise/warm_pool.py): flush stdout and
stderr, then exit with the status ``sys.exit(main())`` would have given. atexit handlers do not
run.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Flush stdio (a pipe to torchrun or the agent, block-buffered), then end the process."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def status_of(exc: SystemExit) -> int:
    """The exit status ``sys.exit(x)`` gives; a non-int, non-None ``x`` is printed, as Python
    does, and is status 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def run_worker(main: Callable[[], int | None]) -> NoReturn:
    """``sys.exit(main())`` for a training script, without the interpreter's teardown: an
    uncaught exception prints its traceback and exits 1, as Python would."""
    code = 1
    try:
        code = main() or 0
    except SystemExit as exc:
        code = status_of(exc)
    except BaseException:  # noqa: BLE001 - report like an uncaught exception would, then exit 1
        traceback.print_exc()
        code = 1
    finally:
        exit_now(code)
