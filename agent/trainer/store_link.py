"""Blocking client of the rendezvous store for the node side (training ranks and the agent).

The agent calls it through ``asyncio.to_thread``; the training ranks call it directly (once per step:
one local round trip). Key names and values are the contract in fleetd.protocol.rendezvous_keys.
It speaks torch's store protocol without torch (fleetd/shared/c10d_store.py), so the agent never
imports torch. Store failures become :class:`StoreLinkError`.
"""

from __future__ import annotations

import threading
import time
from typing import Any, TypeVar

from fleetd.protocol import rendezvous_keys as keys
from fleetd.protocol.errors import ProtocolError
from fleetd.shared.c10d_store import C10dStoreClient, StoreWireError
from fleetd.shared.logs import get_logger

log = get_logger(__name__)
V = TypeVar("V", bound=keys._Value)


class StoreLinkError(Exception):
    """The rendezvous store could not be reached or answered nonsense."""


class StoreLink:
    def __init__(self, host: str, port: int, run_id: str, *, timeout_s: float = 10.0) -> None:
        self.host, self.port, self.run_id = host, port, run_id
        self._timeout_s = timeout_s
        self._store: C10dStoreClient | None = None
        self._lock = threading.Lock()

    def connect(self) -> StoreLink:
        try:
            self._store = C10dStoreClient(self.host, self.port, timeout_s=self._timeout_s).connect()
        except StoreWireError as exc:
            raise StoreLinkError(str(exc)) from None
        return self

    def drop(self) -> None:
        """Forget the connection (the store went away): the next call connects again."""
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()

    def reconnect(self, timeout_s: float) -> StoreLink:
        """Connect again with a short timeout (a training rank retries between steps and must not
        block long on a store that is still down), then use the normal timeout for calls."""
        try:
            store = C10dStoreClient(self.host, self.port, timeout_s=timeout_s).connect()
        except StoreWireError as exc:
            raise StoreLinkError(str(exc)) from None
        store.set_timeout(self._timeout_s)
        with self._lock:
            self._store = store
        return self

    def _op(self, name: str, *args: Any) -> Any:
        if self._store is None:
            self.connect()
        with self._lock:
            store = self._store
            if store is None:  # dropped by another thread since the check above
                raise StoreLinkError(f"store {name}: connection dropped")
            try:
                return getattr(store, name)(*args)
            except StoreWireError as exc:
                # The client closed itself; it fails fast until drop() or reconnect(), as torch's did.
                raise StoreLinkError(f"store {name} failed: {exc}") from None

    def _read(self, model: type[V], key: str) -> V | None:
        if not self._op("check", [key]):
            return None
        try:
            return keys.parse_value(model, self._op("get", key))
        except ProtocolError as exc:
            log.warning("store_bad_value", key=key, error=str(exc))
            return None

    def incarnation(self) -> str | None:
        """Which life of the rendezvous host this store is (None: not written yet). A different
        value than before means the store restarted empty (fleetd.protocol.rendezvous_keys)."""
        key = keys.HOST_INCARNATION_KEY
        if not self._op("check", [key]):
            return None
        return bytes(self._op("get", key)).decode(errors="replace")

    # ------------------------------------------------------------------ checkpoint requests
    def request_checkpoint(
        self, reason: str, *, hold: bool = False, leaving: tuple[str, ...] = (), by: str = ""
    ) -> int:
        seq = int(self._op("add", keys.request_seq_key(self.run_id), 1))
        req = keys.CheckpointRequest(seq=seq, reason=reason, hold=hold, leaving=leaving, requested_by=by)
        self._op("set", keys.request_key(self.run_id, seq), req.to_bytes())
        return seq

    def bump_progress(self) -> int:
        """Say the job completed steps since the last bump (rank 0; see keys.progress_key)."""
        return int(self._op("add", keys.progress_key(self.run_id), 1))

    def latest_request_seq(self) -> int:
        """The newest request number (0: none yet). Never blocks: ``add(key, 0)``."""
        return int(self._op("add", keys.request_seq_key(self.run_id), 0))

    def request(self, seq: int, wait_s: float = 5.0) -> keys.CheckpointRequest | None:
        """Request ``seq``; its writer bumps the number before writing the value, so wait a little."""
        key = keys.request_key(self.run_id, seq)
        until = time.monotonic() + wait_s
        while not self._op("check", [key]):
            if time.monotonic() > until:
                return None
            time.sleep(0.005)
        return self._read(keys.CheckpointRequest, key)

    def ack(self, ack: keys.CheckpointAck) -> None:
        self._op("set", keys.ack_key(self.run_id, ack.seq, ack.rank), ack.to_bytes())
        self._op("add", keys.ack_count_key(self.run_id, ack.seq), 1)

    def acks(self, seq: int) -> list[keys.CheckpointAck]:
        count = int(self._op("add", keys.ack_count_key(self.run_id, seq), 0))
        out: list[keys.CheckpointAck] = []
        rank = 0
        while len(out) < count and rank < 4096:
            a = self._read(keys.CheckpointAck, keys.ack_key(self.run_id, seq, rank))
            if a is not None:
                out.append(a)
            rank += 1
        return out

    def answered(self, seq: int) -> bool:
        """Has any rank acknowledged request ``seq``? One round trip, never blocks."""
        return int(self._op("add", keys.ack_count_key(self.run_id, seq), 0)) > 0

    def released(self, seq: int) -> bool:
        return bool(self._op("check", [keys.release_key(self.run_id, seq)]))

    # ------------------------------------------------------------------ leaving
    def mark_drain_ready(self, addr: str, value: keys.DrainReady) -> None:
        self._op("set", keys.drain_ready_key(self.run_id, addr), value.to_bytes())

    def leave_requested(self, addr: str) -> keys.Leave | None:
        return self._read(keys.Leave, keys.leave_key(self.run_id, addr))

    def has_left(self, addr: str) -> bool:
        return bool(self._op("check", [keys.left_key(self.run_id, addr)]))

    def mark_noticed(self, addr: str, value: keys.Noticed) -> None:
        self._op("set", keys.noticed_key(self.run_id, addr), value.to_bytes())

    def noticed(self, addr: str) -> keys.Noticed | None:
        return self._read(keys.Noticed, keys.noticed_key(self.run_id, addr))

    def announce_salvage(self, value: keys.Salvaged, *, tries: int = 8) -> None:
        """Raise the job's salvaged step to ``value.step``, never lower it (compare-and-set)."""
        key = keys.salvaged_key(self.run_id)
        for _ in range(tries):
            current, raw = self._salvaged_raw()
            if current is not None and current.step >= value.step:
                return
            if bytes(self._op("compare_set", key, raw, value.to_bytes())) == value.to_bytes():
                return

    def give_up_salvage(self, seen: keys.Salvaged, step: int) -> None:
        """Lower the salvaged step to ``step`` while it is still ``seen``'s: nobody supplied it."""
        current, raw = self._salvaged_raw()
        if current is not None and current.step == seen.step and current.addr == seen.addr:
            lowered = keys.Salvaged(step=step, addr=seen.addr)
            self._op("compare_set", keys.salvaged_key(self.run_id), raw, lowered.to_bytes())

    def salvaged(self) -> keys.Salvaged | None:
        return self._salvaged_raw()[0]

    def _salvaged_raw(self) -> tuple[keys.Salvaged | None, bytes]:
        """The value and its stored bytes (b"": no key; compare_set's expected value)."""
        key = keys.salvaged_key(self.run_id)
        if not self._op("check", [key]):
            return None, b""
        raw = bytes(self._op("get", key))
        try:
            return keys.parse_value(keys.Salvaged, raw), raw
        except ProtocolError as exc:
            log.warning("store_bad_value", key=key, error=str(exc))
            return None, raw

    def mark_member(self, addr: str, value: keys.Member) -> None:
        self._op("set", keys.member_key(self.run_id, addr), value.to_bytes())

    def member(self, addr: str) -> keys.Member | None:
        return self._read(keys.Member, keys.member_key(self.run_id, addr))

    def mark_left(self, addr: str, value: keys.Left) -> None:
        self._op("set", keys.left_key(self.run_id, addr), value.to_bytes())
