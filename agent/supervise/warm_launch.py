"""``python -m agent.supervise.warm_launch <module> [args...]`` (or ``--script <path> [args...]``):
torchrun's worker entrypoint when the node has a warm pool (agent/supervise/warm_pool.py). Stdlib
only, so it starts fast.

It asks the pool (``$FLEETD_WARM_POOL``) to fork the worker with this process's argv, environment,
cwd and stdio; relays SIGTERM/SIGINT/SIGHUP and the user signals to it (folder mode asks a script
to save with SIGUSR1, agent/supervise/folder_hooks.py); and exits with its status. Without a pool
it execs an ordinary (cold) ``python -m <module>`` or ``python <path>``.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from typing import NoReturn

from agent.supervise.warm_pool import recv_msg, send_msg

ENV_SOCKET = "FLEETD_WARM_POOL"
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
SCRIPT_FLAG = "--script"


def _cold(argv: list[str], module: bool) -> NoReturn:
    os.execv(sys.executable, [sys.executable, "-u", *(["-m"] if module else []), *argv])


def _connect(conn: socket.socket, path: str, wait_s: float) -> None:
    """Connect, waiting while the pool is still importing (its socket appears when it is warm):
    waiting for it is faster than a cold start that imports torch all over again."""
    until = time.monotonic() + wait_s
    while True:
        try:
            conn.connect(path)
            return
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() >= until:
                raise
            time.sleep(0.02)


def main() -> None:
    argv = sys.argv[1:]
    module = not (argv and argv[0] == SCRIPT_FLAG)
    if not module:
        argv = argv[1:]
    if not argv:
        print(
            f"usage: python -m agent.supervise.warm_launch (<module> | {SCRIPT_FLAG} <path>) [args...]", file=sys.stderr
        )
        sys.exit(2)
    path = os.environ.get(ENV_SOCKET)
    if not path:
        _cold(argv, module)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Held from before the fork until the relay is in place: the worker runs (and torchrun may
    # stop it) before the pool's reply with its pid arrives, and a SIGTERM in that window would
    # end this launcher by default and lose the worker's salvage. Held signals arrive at the relay.
    signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)
    try:
        _connect(conn, path, float(os.environ.get("FLEETD_WARM_WAIT_S", "30")))
        # The environment travels whole, pool socket included: a forked torchrun's own workers
        # are forked from the same pool.
        send_msg(conn, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "module": module}, [0, 1, 2])
        pid = recv_msg(conn)[0]["pid"]
    except (OSError, ConnectionError, KeyError, ValueError) as exc:
        print(f"warm_launch: pool unavailable ({exc}); starting a cold worker", file=sys.stderr)
        conn.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)  # exec keeps the mask: not for the worker
        _cold(argv, module)
        return

    def relay(sig: int, _frame: object) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in RELAYED:
        signal.signal(sig, relay)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
    try:
        code = int(recv_msg(conn)[0]["exit"])
    except (OSError, ConnectionError, KeyError, ValueError):
        code = 1  # the pool died: the worker died with it
    if code < 0:  # killed by a signal: end the same way, so torchrun reports the same thing
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
