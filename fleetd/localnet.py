"""Local ports: for the processes fleetd starts on one machine (demo, benchmarks, test harness),
and a plain TCP probe of a port (is the rendezvous store up?)."""

from __future__ import annotations

import asyncio
import socket
import time

from fleetd.shared.waits import within


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it; a race with another binder is possible
    but harmless for local tools, which fail loudly if it happens)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _try_connect(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_port(host: str, port: int, timeout: float = 20.0) -> None:
    until = time.monotonic() + timeout
    while not _try_connect(host, port):
        if time.monotonic() > until:
            raise TimeoutError(f"nothing listening on {host}:{port} after {timeout:.0f}s")
        time.sleep(0.05)


async def wait_port_async(host: str, port: int, timeout: float = 20.0) -> None:
    until = time.monotonic() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection(host, port)
            writer.close()
            await writer.wait_closed()
            return
        except OSError:
            if time.monotonic() > until:
                raise TimeoutError(f"nothing listening on {host}:{port} after {timeout:.0f}s") from None
            await asyncio.sleep(0.1)


def raise_if_cancelled() -> None:
    """Python 3.11's wait_for loses a cancellation that arrives as its inner call fails (a
    refused connect fails at once): the task would run on, uncancellable, and hold up whatever
    waits for it (an HA leader stepping down, the daemon's shutdown). Raise it again."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def port_answers(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Does something accept a connection there (the rendezvous store, probed by the steering and the
    stall watcher)? A plain TCP connect: cheap, no torch, independent of the store client (whose
    reconnects back off while the store is down)."""
    try:
        _, writer = await within(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError):
        raise_if_cancelled()
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return True
