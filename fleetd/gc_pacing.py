"""Full garbage collections between reconcile passes, never inside one.

CPython starts a full (generation 2) collection on its own once enough objects have survived
younger ones, whatever the process is doing. A pass at 2,000 nodes leaves its observation (2,000
nodes, their rows) alive until the next pass, so every ~15th pass ran a full collection in its
middle: 20-26 ms on an idle box (gc callbacks around bench/reconcile_pass.py: 8 in 120 passes),
several times that on a loaded one, and they were the periodic spikes in the pass time. The
daemon turns the automatic full collections off and runs one right after a pass, at most every
``every_s``; the younger generations (where most of a pass's garbage dies) run as before, and
a reference cycle that reaches the oldest generation waits at most ``every_s`` to be freed.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from prometheus_client import Histogram

FULL_EVERY_S = 60.0
NEVER = 1 << 30  # generation-1 collections before an automatic full one

FULL_SECONDS = Histogram(
    "fleetd_gc_full_seconds",
    "Full garbage collections, run between passes",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
)


# The thresholds before the first install, and how many pacers are installed: several daemons
# in one process (the HA tests run two or three) must leave the interpreter as they found it.
_saved: tuple[int, int, int] | None = None
_installed = 0


class GcPacing:
    def __init__(self, every_s: float = FULL_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self.collections = 0
        self._active = False
        self._last = clock()

    def install(self) -> None:
        global _saved, _installed
        if self._active:
            return
        if _installed == 0:
            _saved = gc.get_threshold()
            gc.set_threshold(_saved[0], _saved[1], NEVER)
        _installed += 1
        self._active = True
        self._last = self.clock()

    def uninstall(self) -> None:
        """Put the interpreter's own thresholds back once the last pacer goes."""
        global _saved, _installed
        if not self._active:
            return
        self._active = False
        _installed -= 1
        if _installed == 0 and _saved is not None:
            gc.set_threshold(*_saved)
            _saved = None

    def after_pass(self) -> None:
        if not self._active or self.clock() - self._last < self.every_s:
            return
        started = time.perf_counter()
        gc.collect()
        FULL_SECONDS.observe(time.perf_counter() - started)
        self.collections += 1
        self._last = self.clock()
