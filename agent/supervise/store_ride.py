"""torchrun rides through a short rendezvous-store outage instead of ending its workers.

Once a round has formed the workers need nothing from the store, but stock torchrun dies with it.
:func:`install` (called by agent.supervise.torchrun_main before torchrun starts) patches the c10d
backend: a failed store call reconnects, the first node on a new store writes its round back, and
``num_nodes_waiting`` answers 0 for up to ``FLEETD_STORE_OUTAGE_S``; agent.trainer.elastic rides
through on the trainer side. Changed torch internals leave torchrun unpatched (slower, still
correct). (docs/DESIGN.md "Rendezvous store crash")
"""

from __future__ import annotations

import copy
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

RECONNECT_EVERY_S = 1.0
CONNECT_TIMEOUT_S = 0.5  # short: a dead store never blocks torchrun's monitor loop for long
DEFAULT_OUTAGE_S = 120.0


def _say(msg: str) -> None:
    print(f"fleetd: {msg}", file=sys.stderr, flush=True)


class _Link:
    """Per backend: where the store is, when it was lost, whether it came back empty."""

    def __init__(self, host: str, port: int, read_timeout: timedelta) -> None:
        self.host, self.port, self.read_timeout = host, port, read_timeout
        self.lock = threading.Lock()
        self.lost_at: float | None = None
        self.tried_at = 0.0
        self.restore = False  # a new store: write our round back on the next sync
        self.held: Any = None  # a copy of the last complete round read from the store
        self.handlers: list[Any] = []


@dataclass(frozen=True)
class _Torch:
    """torch's private rendezvous classes, patched by :func:`install`: typed as the dynamic objects
    they are here."""

    tcp_store: Any  # torch.distributed.TCPStore
    connection_error: type[Exception]  # RendezvousConnectionError
    backend_cls: Any  # C10dRendezvousBackend
    holder_cls: Any  # _BackendRendezvousStateHolder
    handler_cls: Any  # DynamicRendezvousHandler


def install(outage_s: float | None = None) -> bool:
    outage = float(os.environ.get("FLEETD_STORE_OUTAGE_S", DEFAULT_OUTAGE_S)) if outage_s is None else outage_s
    torch = _torch_internals()
    if torch is None:
        return False
    backend_cls, holder_cls, handler_cls = torch.backend_cls, torch.holder_cls, torch.handler_cls
    # Every original is taken before anything is patched.
    call_store = _ride_call_store(torch, backend_cls._call_store)
    sync = _restore_on_sync(holder_cls.sync)
    num_nodes_waiting = _none_waiting_in_outage(torch, handler_cls.num_nodes_waiting, outage)
    init = _register_handler(torch, handler_cls.__init__)
    keep_alive = _keep_alive_survives(handler_cls._keep_alive)
    backend_cls._call_store = call_store
    handler_cls._keep_alive = keep_alive
    holder_cls.sync = sync
    handler_cls.num_nodes_waiting = num_nodes_waiting
    handler_cls.__init__ = init
    return True


def _torch_internals() -> _Torch | None:
    """The classes to patch, once every attribute the patches rely on is checked to be there;
    None (said on stderr) when torch changed them: torchrun then runs unpatched."""
    try:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]  # torch re-exports it without `as`/__all__
        from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as cb
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        torch = _Torch(
            TCPStore,
            RendezvousConnectionError,
            cb.C10dRendezvousBackend,
            dr._BackendRendezvousStateHolder,
            dr.DynamicRendezvousHandler,
        )
        for owner, name in (
            (torch.backend_cls, "_call_store"),
            (torch.holder_cls, "sync"),
            (torch.handler_cls, "num_nodes_waiting"),
            (torch.handler_cls, "__init__"),
            (torch.handler_cls, "_keep_alive"),
        ):
            if not callable(getattr(owner, name, None)):
                raise AttributeError(f"{owner.__name__}.{name} is gone")
        if not hasattr(torch.backend_cls, "_NULL_SENTINEL"):
            raise AttributeError("C10dRendezvousBackend._NULL_SENTINEL is gone")
    except (ImportError, AttributeError) as exc:
        _say(f"torchrun will not ride through a store outage: {exc}")
        return None
    return torch


def _link_of(torch: _Torch, backend: Any) -> _Link | None:
    """The backend's link (made on first use); None for a backend not on a TCPStore."""
    link = getattr(backend, "_fleetd_link", None)
    if link is None:
        store = getattr(backend, "_store", None)
        if not isinstance(store, torch.tcp_store):
            return None
        # Store.timeout is a property at runtime; torch's stubs leave it out.
        link = backend._fleetd_link = _Link(store.host, store.port, store.timeout)
    return link


def _reconnect(torch: _Torch, backend: Any, link: _Link) -> bool:
    """A new connection to the store (at most once per RECONNECT_EVERY_S); True if it answered."""
    now = time.monotonic()
    if now - link.tried_at < RECONNECT_EVERY_S:
        return False
    link.tried_at = now
    try:
        store = torch.tcp_store(
            link.host, link.port, is_master=False, multi_tenant=True, timeout=timedelta(seconds=CONNECT_TIMEOUT_S)
        )
        store.set_timeout(link.read_timeout)
        # A new store lacks the key torch's reads block on: seed its "no state" value. An
        # existing value (the store only blipped, or a peer got here first) is kept.
        seeded = store.compare_set(backend._key, "", torch.backend_cls._NULL_SENTINEL)
    except (RuntimeError, ValueError, TimeoutError, OSError):
        return False
    backend._store = store
    for handler in link.handlers:
        handler._store = store  # the next round's PrefixStore is built on it
    link.restore = seeded == torch.backend_cls._NULL_SENTINEL.encode()
    down = now - link.lost_at if link.lost_at is not None else 0.0
    link.lost_at = None
    _say(f"rendezvous store reconnected after {down:.1f} s ({'empty: a new store' if link.restore else 'same'})")
    return True


def _ride_call_store(torch: _Torch, orig_call: Any) -> Callable[..., Any]:
    """C10dRendezvousBackend._call_store: a failed call reconnects and is tried once more."""

    def call_store(self: Any, store_op: str, *args: Any, **kwargs: Any) -> Any:
        link = _link_of(torch, self)
        if link is None:
            return orig_call(self, store_op, *args, **kwargs)
        try:
            return orig_call(self, store_op, *args, **kwargs)
        except torch.connection_error:
            with link.lock:
                if link.lost_at is None:
                    link.lost_at = time.monotonic()
                    _say("rendezvous store lost; workers keep training, reconnecting")
                if not _reconnect(torch, self, link):
                    raise
            try:
                return orig_call(self, store_op, *args, **kwargs)
            except torch.connection_error:
                with link.lock:  # answered the connect, failed the call: still an outage
                    link.lost_at = link.lost_at or time.monotonic()
                raise

    return call_store


def _restore_on_sync(orig_sync: Any) -> Callable[[Any], Any]:
    """_BackendRendezvousStateHolder.sync: the first node on a new store writes its round back."""

    def sync(self: Any) -> Any:
        # The reconnect happens inside a sync (its read fails first), and that sync then reads
        # the new store's "no state": keep what this node held before, to write it back.
        before = self._state
        result = orig_sync(self)
        link = getattr(self._backend, "_fleetd_link", None)
        if link is None:
            return result
        # A read of "no state" (token None) after a complete round means the store lost it, however
        # this node's connection learnt of it: the store never deletes its state otherwise.
        lost_round = self._token is None and link.held is not None
        if link.restore or lost_round:
            link.restore = False
            held = _qualifies(before) or (copy.deepcopy(link.held) if link.held is not None else None)
            if held is not None and not self._state.participants:
                now = datetime.now(UTC)
                # Every member was alive when the store went (a stale one is dropped later by the
                # usual rules): the steering sees the same round, a newcomer lands in the wait list.
                for node in held.participants:
                    held.last_heartbeats[node] = now
                # Succeeds only while the store still holds the sentinel: the first node wins.
                won = self._backend.set_state(pickle.dumps(held), None)
                _say(
                    f"round {held.round} written back to the new store ({len(held.participants)} members)"
                    if won is not None and won[2]
                    else f"round {held.round} not written back: a peer wrote its copy first"
                )
            else:
                # Said, so that a store that stays without a round says which condition failed.
                _say(
                    "round not written back: held round "
                    f"{getattr(before, 'round', None)} complete={getattr(before, 'complete', None)} "
                    f"members={len(getattr(before, 'participants', ()) or ())}, last complete round "
                    f"{'kept' if link.held is not None else 'none'}; the store holds "
                    f"{len(self._state.participants)} members"
                )
            self._dirty, self._token, self._last_sync_time = False, None, -1
            result = orig_sync(self)  # what the store holds now (ours, or a peer's copy)
        if self._token is not None:  # a real state was read: remember it only while it is a round
            link.held = copy.deepcopy(self._state) if _qualifies(self._state) is not None else None
        return result

    return sync


def _qualifies(state: Any) -> Any:
    """``state`` if it is a complete round with members (worth writing back), else None."""
    return state if getattr(state, "complete", False) and getattr(state, "participants", None) else None


def _none_waiting_in_outage(torch: _Torch, orig_waiting: Any, outage: float) -> Callable[[Any], int]:
    """DynamicRendezvousHandler.num_nodes_waiting: 0 while the store is out, up to ``outage`` s."""

    def num_nodes_waiting(self: Any) -> int:
        # torchrun's elastic agent asks this every monitor interval, and the first failed read ended
        # the agent and every worker. Past ``outage`` it raises again: store_watch then restarts
        # torchrun once the store answers.
        try:
            waiting: int = orig_waiting(self)
            return waiting
        except torch.connection_error:
            link = getattr(self._state_holder._backend, "_fleetd_link", None)
            if link is None or link.lost_at is None or time.monotonic() - link.lost_at > outage:
                raise
            return 0

    return num_nodes_waiting


def _register_handler(torch: _Torch, orig_init: Any) -> Callable[..., None]:
    """DynamicRendezvousHandler.__init__: the handler joins its backend's link, so that a reconnect
    moves it to the new store too."""

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        link = _link_of(torch, getattr(getattr(self, "_state_holder", None), "_backend", None))
        if link is not None:
            link.handlers.append(self)

    return init


def _keep_alive_survives(orig_keep_alive: Any) -> Callable[[Any], None]:
    """DynamicRendezvousHandler._keep_alive: a failed beat is logged, never ends the thread."""

    def keep_alive(self: Any) -> None:
        # torch's keep-alive thread (_PeriodicTimer) dies on any exception but RendezvousError,
        # and then this node never heartbeats again: fleetd's steering removes it as dead at the
        # next pause. An outage must not be able to do that.
        try:
            orig_keep_alive(self)
        except Exception as exc:  # noqa: BLE001 - logged; the next beat tries again
            _say(f"keep-alive failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})")

    return keep_alive
