"""fleetd's client of the rendezvous store: read torchrun's state, steer it, run the checkpoint
handshake. Async on the outside; the blocking c10d client runs in a worker thread
(``asyncio.to_thread``), one operation at a time.

torch's errors (RuntimeError/ValueError/TimeoutError from the C++ store) become
:class:`RendezvousUnavailable`; a state fleetd cannot read becomes :class:`RendezvousStateError`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from fleetd.localnet import port_answers
from fleetd.protocol import rendezvous_keys as keys
from fleetd.protocol.errors import ProtocolError
from fleetd.rendezvous import state as codec
from fleetd.rendezvous.errors import RendezvousConflict, RendezvousUnavailable
from fleetd.rendezvous.state import RendezvousState
from fleetd.shared.logs import get_logger
from fleetd.shared.waits import wait_set

log = get_logger(__name__)
T = TypeVar("T")
# observe_with's entry for the store's key count (no store key can have this name: keys are dotted).
KEY_COUNT = " key-count"
V = TypeVar("V", bound=keys._Value)


@dataclass(frozen=True, slots=True)
class Snapshot:
    state: RendezvousState | None  # None: no rendezvous yet (no key, or torch's empty sentinel)
    token: bytes | None  # the raw stored value, for compare-and-set; None: key absent


class RendezvousClient:
    def __init__(self, host: str, port: int, run_id: str, *, timeout_s: float = 5.0) -> None:
        self.host, self.port, self.run_id = host, port, run_id
        self.timeout_s = timeout_s
        self._store: Any = None
        self._lock = threading.Lock()  # the c10d client is one socket: one operation at a time
        self._state_key = keys.torch_state_key(run_id)

    # ------------------------------------------------------------------ plumbing
    async def connect(self) -> RendezvousClient:
        def _open() -> Any:
            from torch.distributed import TCPStore  # type: ignore[attr-defined]  # torch re-exports TCPStore without `as`/__all__

            return TCPStore(
                self.host,
                self.port,
                is_master=False,
                multi_tenant=True,
                timeout=timedelta(seconds=self.timeout_s),
            )

        try:
            self._store = await asyncio.to_thread(_open)
        except (RuntimeError, ValueError, TimeoutError, OSError) as exc:
            raise RendezvousUnavailable(f"rendezvous store {self.host}:{self.port} unreachable: {exc}") from None
        return self

    async def reconnect_when_answering(self, stop: asyncio.Event, probe_s: float = 0.5) -> None:
        """After an outage: a plain TCP probe every ``probe_s`` (torch's client would block
        seconds per try and print a C++ stack trace each time), then one reconnect."""
        while not stop.is_set():
            if await port_answers(self.host, self.port):
                try:
                    await self.connect()
                    return
                except RendezvousUnavailable:
                    pass  # listening but not serving yet
            await wait_set(stop, probe_s)

    async def close(self) -> None:
        self._store = None

    async def __aenter__(self) -> RendezvousClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _call(self, fn: Callable[[Any], T]) -> T:
        if self._store is None:
            raise RendezvousUnavailable("not connected")
        with self._lock:
            try:
                return fn(self._store)
            except (RuntimeError, ValueError, TimeoutError) as exc:
                raise RendezvousUnavailable(f"rendezvous store operation failed: {exc}") from None

    async def _run(self, fn: Callable[[Any], T]) -> T:
        return await asyncio.to_thread(self._call, fn)

    async def _get_optional(self, key: str) -> bytes | None:
        def op(s: Any) -> bytes | None:
            return s.get(key) if s.check([key]) else None  # get() on a missing key blocks

        return await self._run(op)

    async def _read(self, model: type[V], key: str) -> V | None:
        raw = await self._get_optional(key)
        if raw is None:
            return None
        try:
            return keys.parse_value(model, raw)
        except ProtocolError as exc:
            log.warning("rendezvous_bad_value", key=key, error=str(exc))
            return None

    # ------------------------------------------------------------------ torchrun's state
    async def observe(self) -> Snapshot:
        raw = await self._get_optional(self._state_key)
        if raw is None:
            return Snapshot(None, None)
        return Snapshot(codec.decode(raw), raw)

    async def observe_with(
        self, extra_keys: list[str], *, key_count: bool = False
    ) -> tuple[Snapshot, dict[str, bytes | None]]:
        """The state plus a batch of other keys, in one hop to the store thread (the steering
        loop runs this many times a second; one thread hop per key would cost real CPU).
        ``key_count``: also the store's number of keys (under ``KEY_COUNT``), read first."""
        wanted = [self._state_key, *extra_keys]

        def op(s: Any) -> dict[str, bytes | None]:
            out: dict[str, Any] = {KEY_COUNT: s.num_keys()} if key_count else {}
            out.update({k: (s.get(k) if s.check([k]) else None) for k in wanted})
            return out

        values = await self._run(op)
        raw = values.pop(self._state_key)
        snap = Snapshot(None, None) if raw is None else Snapshot(codec.decode(raw), raw)
        return snap, values

    async def read_keys(self, wanted: list[str]) -> dict[str, bytes | None]:
        """Several optional keys in one hop (absent: None)."""
        return await self._run(lambda s: {k: (s.get(k) if s.check([k]) else None) for k in wanted})

    def parse(self, model: type[V], key: str, raw: bytes | None) -> V | None:
        if raw is None:
            return None
        try:
            return keys.parse_value(model, raw)
        except ProtocolError as exc:
            log.warning("rendezvous_bad_value", key=key, error=str(exc))
            return None

    async def update(
        self,
        change: Callable[[RendezvousState], RendezvousState | None],
        *,
        attempts: int = 50,
    ) -> RendezvousState | None:
        """Read-modify-write with compare-and-set, retrying when a node wrote in between.

        ``change`` returns the new state, or None for "nothing to do" (then nothing is written).
        Returns the state written, or None when there was nothing to change.
        """
        for _ in range(attempts):
            snap = await self.observe()
            if snap.state is None or snap.token is None:
                return None
            new = change(snap.state)
            if new is None or new == snap.state:
                return None
            desired = codec.encode(new)
            token = snap.token

            def cas(s: Any, token: Any = token, desired: bytes = desired) -> bytes:
                swapped: bytes = s.compare_set(self._state_key, token, desired)
                return swapped

            if await self._run(cas) == desired:
                return new
        raise RendezvousConflict(f"compare-and-set on {self._state_key} lost {attempts} times in a row")

    # ------------------------------------------------------------------ checkpoint handshake
    async def request_checkpoint(
        self, reason: str, *, hold: bool = False, leaving: tuple[str, ...] = (), by: str = "fleetd"
    ) -> int:
        seq_key = keys.request_seq_key(self.run_id)

        def op(s: Any) -> int:
            seq = int(s.add(seq_key, 1))
            req = keys.CheckpointRequest(seq=seq, reason=reason, hold=hold, leaving=leaving, requested_by=by)
            s.set(keys.request_key(self.run_id, seq), req.to_bytes())
            return seq

        seq = await self._run(op)
        log.info("checkpoint_requested", seq=seq, reason=reason, hold=hold, leaving=list(leaving))
        return seq

    async def latest_request_seq(self) -> int:
        """The newest checkpoint request's number (0: none yet); never blocks."""
        return await self._run(lambda s: int(s.add(keys.request_seq_key(self.run_id), 0)))

    async def request(self, seq: int) -> keys.CheckpointRequest | None:
        return await self._read(keys.CheckpointRequest, keys.request_key(self.run_id, seq))

    async def ack_count(self, seq: int) -> int:
        return await self._run(lambda s: int(s.add(keys.ack_count_key(self.run_id, seq), 0)))

    async def acks(self, seq: int) -> list[keys.CheckpointAck]:
        """Every rank's ack for request ``seq`` (ranks 0..world-1 as far as they are present)."""
        count = await self._run(lambda s: int(s.add(keys.ack_count_key(self.run_id, seq), 0)))
        out: list[keys.CheckpointAck] = []
        rank = 0
        while len(out) < count and rank < 4096:
            ack = await self._read(keys.CheckpointAck, keys.ack_key(self.run_id, seq, rank))
            if ack is not None:
                out.append(ack)
            rank += 1
            if out and rank >= out[0].world_size:
                break
        return out

    async def release(self, seq: int) -> None:
        await self._run(lambda s: s.set(keys.release_key(self.run_id, seq), b"1"))

    async def drain_ready(self, addr: str) -> keys.DrainReady | None:
        return await self._read(keys.DrainReady, keys.drain_ready_key(self.run_id, addr))

    async def left(self, addr: str) -> keys.Left | None:
        return await self._read(keys.Left, keys.left_key(self.run_id, addr))

    async def tell_leave(self, addr: str, reason: str) -> None:
        value = keys.Leave(reason=reason).to_bytes()
        await self._run(lambda s: s.set(keys.leave_key(self.run_id, addr), value))

    async def forget_node(self, addr: str) -> None:
        """Clear a node's drain keys, so an address reused by a later instance starts clean."""

        def op(s: Any) -> None:
            for k in (keys.drain_ready_key, keys.leave_key, keys.left_key, keys.noticed_key, keys.member_key):
                s.delete_key(k(self.run_id, addr))

        await self._run(op)
