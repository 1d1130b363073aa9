"""The rendezvous host: a long-lived process that owns the job's c10d TCPStore.

If the process hosting the store dies, every torchrun dies within about a second (DESIGN.md). So
the store lives here, in its own systemd unit, and not inside fleetd: fleetd can be restarted,
upgraded or SIGKILLed while training goes on, and reconnects as a client.

The store has no authentication and its values are unpickled by torchrun: bind it to the fleet's
private address only (the unit's firewall rules admit fleet nodes only).
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import TYPE_CHECKING

from fleetd.protocol import rendezvous_keys as keys
from fleetd.rendezvous.errors import RendezvousUnavailable
from fleetd.shared.logs import get_logger
from fleetd.shared.sdnotify import Notifier

if TYPE_CHECKING:
    # Where torch defines it (torch.distributed re-exports it, not explicitly for a type checker).
    from torch._C._distributed_c10d import TCPStore

log = get_logger(__name__)

_HEALTH_KEY = "fleetd.host.health"


@dataclass(frozen=True, slots=True)
class HostSpec:
    host: str
    port: int
    health_interval_s: float = 5.0


def open_server(host: str, port: int) -> TCPStore:
    """Bind the store server. Raises RendezvousUnavailable when the address cannot be bound."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # torch re-exports TCPStore without `as`/__all__

    try:
        return TCPStore(
            host,
            port,
            is_master=True,
            multi_tenant=True,  # torchrun's c10d backend opens the same store from other processes
            wait_for_workers=False,
            timeout=timedelta(seconds=30),
        )
    except (RuntimeError, ValueError, OSError) as exc:
        raise RendezvousUnavailable(f"cannot host the rendezvous store on {host}:{port}: {exc}") from None


def serve(spec: HostSpec, stop: threading.Event, notifier: Notifier | None = None) -> None:
    """Host the store until ``stop`` is set. The server runs in torch's own thread; this thread
    only proves it is alive (one store round trip per interval) for systemd's watchdog."""
    store = open_server(spec.host, spec.port)
    notifier = notifier or Notifier(None)
    incarnation = f"{uuid.uuid4().hex}@{time.time():.3f}"
    # Before anyone can read the store: clients compare it to tell a restarted (empty) store.
    store.set(keys.HOST_INCARNATION_KEY, incarnation)
    log.info("rendezvous_host_ready", host=spec.host, port=store.port, incarnation=incarnation)
    notifier.ready(f"hosting the rendezvous store on {spec.host}:{store.port}")
    try:
        while not stop.wait(spec.health_interval_s):
            started = time.monotonic()
            try:
                store.add(_HEALTH_KEY, 1)
            except RuntimeError as exc:  # the server thread is gone: let systemd restart us
                log.error("rendezvous_host_unhealthy", error=str(exc))
                raise RendezvousUnavailable(str(exc)) from None
            notifier.watchdog_ping()
            elapsed = time.monotonic() - started
            if elapsed > 1.0:
                log.warning("rendezvous_host_slow", round_trip_s=round(elapsed, 3))
    finally:
        notifier.stopping("rendezvous host stopping")
        log.info("rendezvous_host_stopping", host=spec.host, port=store.port)
        del store  # closes the listening socket; nodes' torchruns will fail from here on


def run_until_signalled(spec: HostSpec) -> int:
    """Entry point body of ``fleetd rendezvous``: serve until SIGTERM or SIGINT."""
    stop = threading.Event()

    def _on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("rendezvous_host_signal", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        serve(spec, stop, Notifier.from_environment())
    except RendezvousUnavailable as exc:
        log.error("rendezvous_host_failed", error=str(exc))
        return 1
    return 0
