"""systemd's notify protocol (sd_notify(3)) in plain Python: READY, WATCHDOG, STOPPING, STATUS.

fleetd, fleetd-rendezvous and fleet-agent run as ``Type=notify`` units with ``WatchdogSec=``. A
message is one datagram of ``KEY=VALUE`` lines to ``$NOTIFY_SOCKET``; without it every call is a
no-op (a terminal, tests, the demo). :func:`watchdog` pings only while the main loop's
:class:`Heartbeat` is fresh (docs/DESIGN.md "Start-up and the production path"). In fleetd.shared
because the agent needs it too.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, MutableMapping

from fleetd.shared.logs import get_logger

log = get_logger(__name__)

# Variables systemd sets for the main process; children (torchrun, trainers) must not inherit
# them, or their own notify-aware code would talk to our unit.
NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def socket_address(name: str) -> str | bytes:
    """Address for ``sendto``: a path, or an abstract name (``@foo`` means ``\\0foo``)."""
    if name.startswith("@"):
        return b"\0" + name[1:].encode()
    return name


class Notifier:
    """Sends notify datagrams to systemd; silently does nothing when not run by systemd.

    Sending never raises: a broken notify socket must not take the daemon down (systemd will notice
    the missing READY or pings by itself).
    """

    def __init__(self, socket_name: str | None, watchdog_usec: int | None = None) -> None:
        self.socket_name = socket_name or None
        self.watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None
        self._sock: socket.socket | None = None

    @classmethod
    def from_environment(cls, environ: MutableMapping[str, str] | None = None, *, unset: bool = True) -> Notifier:
        """Read ``NOTIFY_SOCKET``/``WATCHDOG_USEC``/``WATCHDOG_PID`` and, by default, remove them
        from the environment (like ``sd_notify(unset_environment=1)``) so child processes do not
        inherit them."""
        env = os.environ if environ is None else environ
        socket_name = env.get("NOTIFY_SOCKET")
        watchdog_usec = _parse_watchdog(env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID"))
        if unset:
            for key in NOTIFY_ENV:
                env.pop(key, None)
        return cls(socket_name, watchdog_usec)

    @property
    def enabled(self) -> bool:
        return self.socket_name is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to ping: half of ``WatchdogSec``, as systemd recommends; None: no watchdog."""
        if self.watchdog_usec is None:
            return None
        return self.watchdog_usec / 2 / 1_000_000

    def send(self, *lines: str) -> bool:
        """Send one datagram made of ``KEY=VALUE`` lines; True if it was handed to the socket."""
        if self.socket_name is None:
            return False
        payload = "\n".join(lines).encode()
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # Never stall the event loop on a full socket buffer: a dropped ping is retried
                # at the next interval, a blocked loop is not.
                sock.setblocking(False)
                self._sock = sock
            self._sock.sendto(payload, socket_address(self.socket_name))
            return True
        except OSError as exc:
            log.warning("sd_notify_failed", socket=self.socket_name, error=str(exc), lines=list(lines))
            return False

    def ready(self, status: str | None = None) -> bool:
        return self.send("READY=1", *_status(status))

    def stopping(self, status: str | None = None) -> bool:
        return self.send("STOPPING=1", *_status(status))

    def status(self, text: str) -> bool:
        return self.send(*_status(text))

    def watchdog_ping(self) -> bool:
        return self.send("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for more time in the current start-up/shutdown phase (``EXTEND_TIMEOUT_USEC``).

        The agent uses it while an upload is finishing during shutdown; systemd still enforces
        ``TimeoutStopSec`` as the outer bound if the extensions stop coming."""
        return self.send(f"EXTEND_TIMEOUT_USEC={max(1, int(seconds * 1_000_000))}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _status(text: str | None) -> tuple[str, ...]:
    if text is None:
        return ()
    # One datagram line per field: a newline inside STATUS would start a bogus field.
    return (f"STATUS={' '.join(text.splitlines())}",)


def _parse_watchdog(usec: str | None, pid: str | None) -> int | None:
    """``WATCHDOG_USEC`` if it is meant for this process (``sd_watchdog_enabled`` semantics)."""
    if not usec:
        return None
    try:
        value = int(usec)
        if pid and int(pid) != os.getpid():
            return None
    except ValueError:
        log.warning("sd_watchdog_env_invalid", watchdog_usec=usec, watchdog_pid=pid)
        return None
    return value if value > 0 else None


# A ping must mean "the daemon does its job", not "the event loop is alive": a main loop stuck
# on a hung call stops beating, the pings stop, and systemd restarts the unit.
class Heartbeat:
    """Proof of progress that the daemon's main loop refreshes once per iteration.

    ``max_silence_s`` must exceed the longest *healthy* gap between two beats (e.g. the reconcile
    interval plus a slow pass); after that the loop is considered stuck and pings stop.
    """

    def __init__(self, max_silence_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_silence_s <= 0:
            raise ValueError("max_silence_s must be > 0")
        self.max_silence_s = max_silence_s
        self._clock = clock
        self._last = clock()
        self._progress: Callable[[], object] | None = None
        self._seen: object = None

    @classmethod
    def following(
        cls, progress: Callable[[], object], max_silence_s: float, clock: Callable[[], float] = time.monotonic
    ) -> Heartbeat:
        """A heartbeat that beats by itself whenever ``progress()`` (e.g. a loop's iteration
        counter) has changed since it last looked; for loops that cannot call ``beat()``.
        It looks at every health check, so staleness is detected within one watchdog interval
        of ``max_silence_s``."""
        hb = cls(max_silence_s, clock)
        hb._progress = progress
        hb._seen = progress()
        return hb

    def beat(self) -> None:
        self._last = self._clock()

    @property
    def silence_s(self) -> float:
        return self._clock() - self._last

    def healthy(self) -> bool:
        if self._progress is not None:
            current = self._progress()
            if current != self._seen:
                self._seen = current
                self.beat()
        return self.silence_s <= self.max_silence_s


async def watchdog(notifier: Notifier, heartbeat: Heartbeat, *, interval_s: float | None = None) -> None:
    """Ping ``WATCHDOG=1`` every ``interval_s`` (default: half of ``WatchdogSec``) while the
    heartbeat is fresh. Returns at once when systemd configured no watchdog; otherwise runs until
    cancelled (run it in the daemon's TaskGroup and cancel it at shutdown)."""
    interval = interval_s if interval_s is not None else notifier.watchdog_interval_s
    if interval is None or not notifier.enabled:
        return
    was_healthy = True
    while True:
        healthy = heartbeat.healthy()
        if healthy:
            notifier.watchdog_ping()
        if healthy != was_healthy:
            # Logged on the transition only: a stuck loop would otherwise flood the journal.
            report = log.info if healthy else log.warning
            report("watchdog_heartbeat", healthy=healthy, silence_s=round(heartbeat.silence_s, 1))
            was_healthy = healthy
        await asyncio.sleep(interval)
