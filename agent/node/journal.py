"""Write entries to journald over its native socket, without libsystemd.

The protocol (systemd's "Native Journal Protocol"): one datagram per entry on
``/run/systemd/journal/socket``, made of ``KEY=VALUE\\n`` fields; a value holding a newline is
sent as ``KEY\\n``, its length as 64-bit little-endian, the bytes, then ``\\n``. Field names are
upper case ASCII letters, digits and underscores, not starting with an underscore (journald
reserves those for the fields it adds itself: ``_PID``, ``_SYSTEMD_UNIT``...).

Sends never block: the socket is non-blocking, and an entry journald cannot take now (its queue is
full) is counted and dropped. The node's output must never wait on its logger: a full pipe would
stop the workers' writes, and training with them.
"""

from __future__ import annotations

import os
import re
import socket
import struct
from collections.abc import Mapping
from pathlib import Path

DEFAULT_SOCKET = Path("/run/systemd/journal/socket")
# Where tests and dev boxes point it elsewhere (or at nothing: "" turns journald off).
SOCKET_ENV = "FLEETD_JOURNAL_SOCKET"
_FIELD = re.compile(r"^[A-Z0-9][A-Z0-9_]{0,63}$")
# journald takes datagrams up to the socket's buffer; larger entries need a memfd, which we do not
# send. Worker lines are capped well below (agent/supervise/worker_output.py), so this only bounds
# a pathological field.
MAX_VALUE_BYTES = 32 * 1024


def encode_entry(fields: Mapping[str, str | int]) -> bytes:
    """One journal entry as the native protocol's datagram. Raises ValueError on a bad field name."""
    out = bytearray()
    for key, value in fields.items():
        if not _FIELD.match(key):
            raise ValueError(f"not a journal field name: {key!r}")
        data = str(value).encode(errors="replace")[:MAX_VALUE_BYTES]
        if b"\n" in data:
            out += key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)


def journal_socket_path() -> Path | None:
    """The journal socket to use: ``$FLEETD_JOURNAL_SOCKET`` if set ("" for none), else the
    system's when it exists; None on a box without journald (tests, dev boxes, containers)."""
    env = os.environ.get(SOCKET_ENV)
    if env is not None:
        return Path(env) if env else None
    return DEFAULT_SOCKET if DEFAULT_SOCKET.exists() else None


class JournalWriter:
    """An unconnected datagram socket aimed at journald. Thread-safe: ``sendto`` on a datagram
    socket writes one whole entry or nothing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sent = 0
        self.dropped = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    @classmethod
    def open(cls, path: Path | None = None) -> JournalWriter | None:
        """A writer for ``path`` (default: ``journal_socket_path()``), or None when there is no
        journal to write to."""
        path = path if path is not None else journal_socket_path()
        if path is None or not path.exists():
            return None
        return cls(path)

    def send(self, fields: Mapping[str, str | int]) -> bool:
        """Send one entry; False (and counted) when journald cannot take it now or is gone."""
        try:
            self._sock.sendto(encode_entry(fields), str(self.path))
        except OSError:
            # EAGAIN: journald's queue is full; ENOENT/ECONNREFUSED: it restarted or went away;
            # EMSGSIZE: an entry too large for a datagram. None of them may reach the workers.
            self.dropped += 1
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        self._sock.close()
