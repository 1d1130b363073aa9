"""A client of torch's c10d TCPStore that speaks its wire protocol with the standard library alone.

Why not ``torch.distributed.TCPStore``: the node agent talks to the rendezvous store (probes,
checkpoint requests, leave marks) and nothing else of torch. Importing torch for that cost every
agent ~1.6 CPU-s and ~200 MB of memory, and the import held the GIL in the agent's process for as
long, right when a node starts. With this client the agent never imports torch; torch stays in
the job's processes (torchrun, the workers) and in the rendezvous host, which serves the store.

The protocol (torch/csrc/distributed/c10d/TCPStore.cpp and TCPStoreBackend.hpp; fleetd accepts
torch 2.11-2.13, fleetd/shared/torch_support.py, and the tests run it against the torch installed):
a client sends VALIDATE with a magic number, then one query at a time, each a one-byte query type
followed by its arguments. Integers are little-endian native sizes (``size_t`` lengths, ``int64``
counters); strings and byte values are a ``uint64`` length and the bytes. torch's client prefixes
every key with ``/``; this one does the same, so both see the same keys. Only what fleetd needs is
here: set, get, add, check, compare_set. Interoperation with torch's own client and server is
tested (tests/test_c10d_store.py).

Blocking and thread-safe (one query at a time on the one socket). Any failure is a
:class:`StoreWireError` and leaves the client closed: a reply half read cannot be resynchronised.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

VALIDATION_MAGIC = 0x3C85F7CE
KEY_PREFIX = "/"
# torch's QueryType (an enum class over uint8_t): its order is the wire value.
VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT = range(7)
PING = 13
CHECK_READY = 0
WAIT_STOPPED = 0
# A reply longer than this is not a rendezvous value: the peer is not a store, or out of step.
MAX_VALUE_BYTES = 64 << 20

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


class StoreWireError(Exception):
    """The store could not be reached, timed out, or answered outside the protocol."""


def _string(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def _key(key: str) -> bytes:
    return _string((KEY_PREFIX + key).encode())


class C10dStoreClient:
    """One connection to a TCPStore server. ``timeout_s`` bounds connecting (refused connections are
    retried until then, as torch's client does while a store starts) and every reply."""

    def __init__(self, host: str, port: int, *, timeout_s: float = 10.0) -> None:
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ connection
    def connect(self) -> C10dStoreClient:
        deadline = time.monotonic() + self.timeout_s
        delay = 0.05
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(0.05, deadline - time.monotonic()))
                break
            except (ConnectionRefusedError, ConnectionResetError) as exc:
                if time.monotonic() + delay >= deadline:
                    raise StoreWireError(f"store {self.host}:{self.port} unreachable: {exc}") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
            except OSError as exc:  # timeout, no route, unknown host: retrying will not help in time
                raise StoreWireError(f"store {self.host}:{self.port} unreachable: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.timeout_s)
        with self._lock:
            self._sock = sock
            try:
                sock.sendall(_U8.pack(VALIDATE) + _U32.pack(VALIDATION_MAGIC))
                # A ping proves the peer is a store that answers, not merely a port that accepts.
                nonce = os.getpid() & 0xFFFFFFFF
                sock.sendall(_U8.pack(PING) + _U32.pack(nonce))
                (echo,) = _U32.unpack(self._recv(4))
            except StoreWireError:
                raise
            except OSError as exc:
                self._fail()
                raise StoreWireError(f"store {self.host}:{self.port} handshake failed: {exc}") from None
            if echo != nonce:
                self._fail()
                raise StoreWireError(f"store {self.host}:{self.port} answered its ping with {echo}, not {nonce}")
        return self

    def close(self) -> None:
        with self._lock:
            self._fail()

    def set_timeout(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        with self._lock:
            if self._sock is not None:
                self._sock.settimeout(timeout_s)

    # ------------------------------------------------------------------ queries
    def set(self, key: str, value: bytes) -> None:
        self._query(_U8.pack(SET) + _key(key) + _string(value), reply=None)

    def get(self, key: str) -> bytes:
        """The value, once the key exists (torch's client waits for it first, as this does)."""
        if self._query(_U8.pack(WAIT) + _U64.pack(1) + _key(key), reply="u8") != WAIT_STOPPED:
            self.close()  # torch's WAIT_CANCELED: only its own client cancels a wait
            raise StoreWireError(f"store {self.host}:{self.port}: the wait for {key} was cancelled")
        return self._query(_U8.pack(GET) + _key(key), reply="bytes")  # type: ignore[return-value]

    def add(self, key: str, amount: int) -> int:
        return self._query(_U8.pack(ADD) + _key(key) + _I64.pack(amount), reply="i64")  # type: ignore[return-value]

    def check(self, keys: list[str]) -> bool:
        body = _U8.pack(CHECK) + _U64.pack(len(keys)) + b"".join(_key(k) for k in keys)
        return self._query(body, reply="u8") == CHECK_READY

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """torch's semantics: a missing key with ``expected`` empty is created; the reply is the
        value the key holds afterwards (``desired`` when the swap happened)."""
        body = _U8.pack(COMPARE_SET) + _key(key) + _string(expected) + _string(desired)
        return self._query(body, reply="bytes")  # type: ignore[return-value]

    # ------------------------------------------------------------------ plumbing
    def _query(self, body: bytes, *, reply: str | None) -> int | bytes | None:
        with self._lock:
            if self._sock is None:
                raise StoreWireError(f"store {self.host}:{self.port}: not connected")
            try:
                self._sock.sendall(body)
                if reply is None:
                    return None
                if reply == "u8":
                    return int(_U8.unpack(self._recv(1))[0])
                if reply == "i64":
                    return int(_I64.unpack(self._recv(8))[0])
                (size,) = _U64.unpack(self._recv(8))
                if size > MAX_VALUE_BYTES:
                    self._fail()
                    raise StoreWireError(f"store {self.host}:{self.port} sent a {size}-byte value")
                return self._recv(size)
            except StoreWireError:
                raise
            except OSError as exc:  # socket.timeout is an OSError
                self._fail()
                raise StoreWireError(f"store {self.host}:{self.port}: {type(exc).__name__}: {exc}") from None

    def _recv(self, n: int) -> bytes:
        """Exactly ``n`` bytes (the caller holds the lock)."""
        assert self._sock is not None
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                self._fail()
                raise StoreWireError(f"store {self.host}:{self.port} closed the connection")
            buf += chunk
        return bytes(buf)

    def _fail(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
