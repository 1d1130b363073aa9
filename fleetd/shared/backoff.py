"""Retries, for the controller and the agent alike: one mechanism, from tenacity.

``retrying(...)`` retries a call until it works (a stop event ends it and raises the last error);
``Backoff`` is the same schedule counted by the caller, for long sessions that start over after
each success (an MQTT connection, the EC2 view's refresh, torchrun restarts). The schedule: exponential
from ``first_s``, doubling, capped at ``max_s``, optionally jittered (docs/DESIGN.md "Layers").
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_never,
    stop_when_event_set,
    wait_exponential,
)
from tenacity.wait import wait_base

from fleetd.shared.waits import wait_set


# Jitter spreads 2,000 agents that lost the same broker over the reconnect window instead of
# having them knock together; loops with one instance (the controller's) need none.
class _jittered(wait_base):
    """``base``'s delay scaled by a uniform factor in [1 - jitter, 1 + jitter]."""

    def __init__(self, base: wait_base, jitter: float) -> None:
        self.base, self.jitter = base, jitter

    def __call__(self, retry_state: RetryCallState) -> float:
        return self.base(retry_state) * random.uniform(1 - self.jitter, 1 + self.jitter)


def schedule(first_s: float, max_s: float, jitter: float = 0.0) -> wait_base:
    """tenacity's exponential wait: ``first_s * 2**(n - 1)`` before try n + 1, at most ``max_s``."""
    base = wait_exponential(multiplier=first_s, min=first_s, max=max_s)
    return _jittered(base, jitter) if jitter else base


async def _sleep(delay: float) -> None:
    await asyncio.sleep(delay)


def _sleep_unless(stop: asyncio.Event) -> Callable[[float], Awaitable[None]]:
    async def sleep(delay: float) -> None:
        await wait_set(stop, delay)  # a stop ends the wait; the stop condition then ends the retries

    return sleep


def retrying(
    first_s: float,
    max_s: float,
    *,
    retry_on: type[BaseException] | tuple[type[BaseException], ...],
    jitter: float = 0.0,
    stop: asyncio.Event | None = None,
    before_sleep: Callable[[RetryCallState], Awaitable[None] | None] | None = None,
) -> AsyncRetrying:
    """Retry what raises ``retry_on`` until it works or ``stop`` is set (then its error is raised).
    ``before_sleep`` is told each failure with ``retry_state.upcoming_sleep`` set (for the log)."""
    return AsyncRetrying(
        wait=schedule(first_s, max_s, jitter),
        retry=retry_if_exception_type(retry_on),
        stop=stop_never if stop is None else stop_when_event_set(stop),  # type: ignore[arg-type]
        sleep=_sleep if stop is None else _sleep_unless(stop),
        before_sleep=before_sleep,
        reraise=True,
    )


def failure_of(state: RetryCallState) -> BaseException:
    """The exception the attempt ``state`` describes failed with (in a ``before_sleep``)."""
    assert state.outcome is not None
    exc = state.outcome.exception()
    assert exc is not None
    return exc


# Counted by the caller: tenacity counts attempts per call, and a session that ran for an hour
# before its connection dropped is no "second attempt"; the loop says where a success resets it.
@dataclass
class Backoff:
    first_s: float = 0.25
    max_s: float = 5.0
    jitter: float = 0.0
    _failures: int = 0  # since the last reset
    _wait: wait_base = field(init=False, repr=False)
    _state: RetryCallState = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._wait = schedule(self.first_s, self.max_s, self.jitter)
        self._state = RetryCallState(Retrying(), None, (), {})

    def next_delay(self) -> float:
        self._failures += 1
        self._state.attempt_number = self._failures
        return self._wait(self._state)

    def reset(self) -> None:
        self._failures = 0
