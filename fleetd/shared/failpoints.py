"""Named crash points for crash-safety tests: ``FLEETD_FAILPOINTS=drain-recorded`` makes the
process SIGKILL itself the first time it reaches ``failpoint("drain-recorded")``;
``FLEETD_FAILPOINTS=fenced-write:stop`` makes it SIGSTOP itself there once (a pause: a GC, a
frozen VM), and it goes on from there when the test sends SIGCONT.

The tests kill a real ``fleetd run`` at the exact instant that matters (a drain recorded but not
sent, a notice received but not recorded, ...) and restart it; a kill from outside could not aim
at a window a few microseconds wide. With the variable unset (production) a failpoint is one dict
lookup. SIGKILL, not an exception: nothing runs after it (no finally, no flush), as in a real crash.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "FLEETD_FAILPOINTS"
_armed: set[str] = {p.strip() for p in os.environ.get(ENV, "").split(",") if p.strip()}


def failpoint(name: str) -> None:
    if f"{name}:stop" in _armed:
        _armed.discard(f"{name}:stop")
        sys.stderr.write(f'{{"event": "failpoint_stop", "failpoint": "{name}", "pid": {os.getpid()}}}\n')
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSTOP)
        sys.stderr.write(f'{{"event": "failpoint_resumed", "failpoint": "{name}", "pid": {os.getpid()}}}\n')
        sys.stderr.flush()
        return
    if name in _armed:
        sys.stderr.write(f'{{"event": "failpoint_kill", "failpoint": "{name}", "pid": {os.getpid()}}}\n')
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
