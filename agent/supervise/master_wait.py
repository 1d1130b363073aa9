"""A worker that is not rank 0 waits for rank 0's store to listen before torch connects to it.

``init_process_group`` (env://) makes rank 0 host a TCPStore on MASTER_PORT and every other rank
a client of it. Workers of a new round start within milliseconds of each other (warm pool), so a
client often tries first, is refused, and torch's client then backs off (exponential, ~0.4-0.6 s
measured here) although the server listens a few milliseconds later: half the time, the single
largest wait of a notice's re-form after the rendezvous itself (docs/measurements/
2026-11-rendezvous.md). :func:`install` (called by agent.supervise.warm_pool in each forked worker)
wraps torch's private ``_create_c10d_store``: a client first polls the port with plain TCP
connects every ``POLL_S``, bounded by the store's own timeout, then lets torch connect at once.
A changed torch runs unpatched (slower, still correct).
"""

from __future__ import annotations

import importlib
import socket
import sys
import time
from datetime import timedelta
from typing import Any

POLL_S = 0.01
CONNECT_TIMEOUT_S = 1.0  # one try; a refused port answers at once, a dropped one must not hang


def wait_listening(host: str, port: int, timeout_s: float) -> bool:
    """True once ``host:port`` accepts a TCP connection, False after ``timeout_s``. The probe
    closes at once; a TCPStore server ignores a connection that never says hello (and counts
    no worker for it)."""
    until = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
                return True
        except OSError:
            if time.monotonic() >= until:
                return False
            time.sleep(POLL_S)


def install() -> bool:
    if "torch" not in sys.modules:
        # The pool did not preload torch: importing it here would cost this worker the cold
        # import the pool exists to save (and start torch's thread in a worker that may never
        # use it). A worker that imports torch itself later runs unpatched.
        return False
    try:
        # By its full name: ``torch.distributed.rendezvous`` as an attribute is a function.
        rdzv = importlib.import_module("torch.distributed.rendezvous")
    except ImportError:
        return False
    original = getattr(rdzv, "_create_c10d_store", None)
    if not callable(original) or getattr(original, "_fleetd_master_wait", False):
        return False

    def _create_c10d_store(
        hostname: str, port: int, rank: int, world_size: int, timeout: timedelta, *args: Any, **kwargs: Any
    ) -> Any:
        if rank != 0:
            # Bounded by the store's timeout: a rank 0 that never comes is torch's to report.
            started = time.monotonic()
            wait_listening(hostname, port, timeout.total_seconds())
            timeout = max(timeout - timedelta(seconds=time.monotonic() - started), timedelta(seconds=1))
        return original(hostname, port, rank, world_size, timeout, *args, **kwargs)

    _create_c10d_store._fleetd_master_wait = True  # type: ignore[attr-defined]  # marks the wrapper
    rdzv._create_c10d_store = _create_c10d_store  # type: ignore[attr-defined]  # torch's private helper
    return True
