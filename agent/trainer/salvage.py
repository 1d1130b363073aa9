"""Save the survivors' replica when a peer dies without notice (just-in-time checkpointing, Gupta et
al., EuroSys'24). A survivor still holds the state after the last step it completed (the broken
collective is the next step's gradient all-reduce, before any parameter changed), so it writes it
to local disk before its worker exits: ``salvage_on_failure()`` on the loop's exception,
``TermWatcher`` on torchrun's SIGTERM while a collective hangs. ``UpdateGuard`` says which step the
parameters hold. Replicated state only: a lost rank's shard goes with it.
(docs/DESIGN.md "A loss without notice")
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

# torchrun's agent waits 30 s after SIGTERM before SIGKILL (PContext.close): a salvage that cannot
# finish well inside that gives up, so a stuck save never delays the re-form by the full 30 s.
SALVAGE_TIMEOUT_S = 20.0
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


class UpdateGuard:
    """Which completed step the parameters hold, from the optimizer's step hooks.

    ``step_done(step)`` names the step the parameters hold; each ``optimizer.step()`` after it adds
    one. A save must not read the parameters while an update is under way, so the pre-hook takes a
    lock the post-hook releases; an update that raised leaves the state unknown (no salvage).
    """

    def __init__(self, optimizer: Any, step: int = 0) -> None:
        # Re-entrant: the main thread salvaging after an update of its own raised must see "torn",
        # not wait for itself.
        self._lock = threading.RLock()
        self._done_step = step
        self._updates = 0
        self._torn = False
        self._ready: Any = None  # CUDA event recorded after the last update (GPU state only)
        self._explicit = False  # the update window opens at about_to_update(), not the pre-hook
        self._frozen = False  # a salvage before exit was taken: no update starts any more
        optimizer.register_step_pre_hook(self._before_update)
        optimizer.register_step_post_hook(self._after_update)

    def update_starts_explicitly(self) -> None:
        """For loops that step the optimizer with a closure (Lightning's automatic optimization
        runs forward and backward inside ``optimizer.step(closure)``): the parameters change only
        after the closure, so the update window opens at ``about_to_update()`` (the framework's
        before-optimizer-step hook), not at the step's pre-hook. A survivor hung in the closure's
        backward (a peer vanished mid all-reduce) then still holds a known, completed step."""
        self._explicit = True

    def about_to_update(self) -> None:
        if self._explicit:
            self._open_update()

    def _before_update(self, *_: Any) -> None:
        if not self._explicit:
            self._open_update()

    def _open_update(self) -> None:
        self._lock.acquire()
        if self._frozen:
            # A SIGTERM salvage saved the state and the process exits next (os._exit from the
            # watcher's thread): this update must not happen, so wait here for the end.
            self._lock.release()
            threading.Event().wait()
        self._torn = True

    def _after_update(self, optimizer: Any, *_: Any) -> None:
        self._updates += 1
        self._torn = False
        self._ready = _cuda_event_after(optimizer)
        self._lock.release()

    def step_done(self, step: int) -> None:
        with self._lock:
            self._done_step, self._updates = step, 0

    @contextlib.contextmanager
    def consistent(self, timeout_s: float, *, keep: bool = False) -> Iterator[tuple[int | None, Any]]:
        """(step the state holds, CUDA event to wait for) while no update can start; step is None
        when it cannot be known: an update raised or is still running, or several updates ran
        since the last ``step_done`` (gradient accumulation done as several optimizer steps).
        ``keep``: no update may start after the block, ever: the process exits next (a SIGTERM
        salvage), and the main thread, which need not be blocked in a collective at all, must not
        apply and report one more step that the save does not hold (the HF worker did: it logged
        step 51 after its salvage saved 50)."""
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):
            yield None, None
            return
        try:
            known = not self._torn and self._updates <= 1
            yield (self._done_step + self._updates if known else None), self._ready
        finally:
            self._frozen = self._frozen or keep
            self._lock.release()


def _cuda_event_after(optimizer: Any) -> Any:
    """An event on the current CUDA stream after the update's kernels (None for CPU state)."""
    params = [p for group in optimizer.param_groups for p in group["params"]][:1]
    if not params or not getattr(params[0], "is_cuda", False):
        return None
    import torch

    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__new__ unannotated
    event.record()
    return event


def host_copy(state: Any, ready: Any) -> Any:
    """``state`` with its CUDA tensors copied to host memory.

    The copy runs on a side stream that waits only for the last update (``ready``): the default
    stream may be queued behind a collective that will never finish, and a copy there would hang
    with it. CPU state is returned as is (``torch.save`` reads it directly).
    """
    if ready is None:
        return state
    import torch

    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
    with torch.cuda.stream(side):
        side.wait_event(ready)
        out = _map_tensors(state, lambda t: t.to("cpu") if t.is_cuda else t)
    side.synchronize()
    return out


def _map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


class TermWatcher:
    """On SIGTERM, run ``salvage`` in a thread of its own, then exit as SIGTERM would have.

    The main thread may be blocked inside the hung collective, and a Python signal handler runs
    only once that call returns: the signal's wakeup fd wakes this thread instead.

    Armed only inside ``ElasticCheckpointer.salvage_on_failure()`` and only when nothing else
    handles SIGTERM (a script's own handler, or an asyncio loop's wakeup fd, is left alone).
    ``arm`` must run in the main thread (Python's rule for signal handlers).
    """

    def __init__(self, salvage: Callable[[str], object], timeout_s: float = SALVAGE_TIMEOUT_S) -> None:
        self._salvage = salvage
        self._timeout_s = timeout_s
        self._pair: tuple[socket.socket, socket.socket] | None = None
        self._thread: threading.Thread | None = None
        self._previous_fd = -1

    def arm(self, *, take_over: bool = False) -> str | None:
        """Start watching; returns why not, if it cannot. ``take_over``: replace a SIGTERM handler
        that is already there (a framework's own, e.g. Lightning's, which runs a collective inside
        the handler and so hangs with the peer it is meant to survive)."""
        if threading.current_thread() is not threading.main_thread():
            return "not the main thread"
        if not take_over and signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return "the script handles SIGTERM itself"
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        if previous != -1:  # someone (an asyncio loop) relies on the wakeup fd: leave it theirs
            signal.set_wakeup_fd(previous)
            reader.close()
            writer.close()
            return "the wakeup fd is in use"
        # The C-level handler writes the signal number to the wakeup fd from whichever thread
        # the kernel picked; this Python-level part runs (late) in the main thread and has
        # nothing left to do.
        signal.signal(signal.SIGTERM, _noop)
        self._pair = (reader, writer)
        self._thread = threading.Thread(target=self._watch, name="fleetd-salvage", daemon=True)
        self._thread.start()
        return None

    def disarm(self) -> None:
        if self._pair is None:
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        reader, writer = self._pair
        self._pair = None
        writer.close()
        with contextlib.suppress(OSError):
            reader.shutdown(socket.SHUT_RDWR)  # wakes the watcher's recv (close alone does not)
        reader.close()
        # Wait for the thread to end: a daemon thread still running when the interpreter exits
        # is unwound by force, which aborts the process ("terminate called without an active
        # exception") once torch's C++ runtime is loaded.
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None

    def _watch(self) -> None:
        assert self._pair is not None
        reader = self._pair[0]
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                self._salvage_and_exit()

    def _salvage_and_exit(self) -> None:
        # A save stuck behind the hung collective must not outlive torchrun's patience.
        deadline = threading.Timer(self._timeout_s, os._exit, (SIGTERM_EXIT_CODE,))
        deadline.daemon = True
        deadline.start()
        try:
            self._salvage("SIGTERM")
        finally:
            os._exit(SIGTERM_EXIT_CODE)


def _noop(signum: int, frame: object) -> None:
    del signum, frame
