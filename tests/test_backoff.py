"""Retries (fleetd/shared/backoff.py, on tenacity): the schedule every reconnect and re-poll uses,
and the retry-until-it-works loop."""

from __future__ import annotations

import asyncio

import pytest

from fleetd.shared.backoff import Backoff, failure_of, retrying


def test_doubles_from_first_to_the_cap_and_starts_over_after_a_reset() -> None:
    b = Backoff(0.5, 3.0)
    assert [b.next_delay() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.reset()
    assert b.next_delay() == 0.5


def test_jitter_stays_inside_its_band_around_the_schedule() -> None:
    b = Backoff(1.0, 8.0, jitter=0.25)
    for expected in (1.0, 2.0, 4.0, 8.0, 8.0):
        assert expected * 0.75 <= b.next_delay() <= expected * 1.25


async def test_retrying_retries_until_it_works_and_says_when_the_next_try_is() -> None:
    calls, told = [], []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise OSError(f"try {len(calls)}")
        return "ok"

    def failed(state) -> None:
        told.append((str(failure_of(state)), state.upcoming_sleep))

    async for attempt in retrying(0.01, 0.02, retry_on=OSError, before_sleep=failed):
        with attempt:
            result = await flaky()
    assert (result, len(calls)) == ("ok", 3)
    assert told == [("try 1", 0.01), ("try 2", 0.02)]

    # A stop ends the retries with the last error; what is not retried is raised at once.
    stop = asyncio.Event()

    def stop_now(state) -> None:
        stop.set()

    with pytest.raises(OSError, match="always"):
        async for attempt in retrying(5.0, 5.0, retry_on=OSError, stop=stop, before_sleep=stop_now):
            with attempt:
                raise OSError("always")
    with pytest.raises(ValueError):
        async for attempt in retrying(0.01, 0.01, retry_on=OSError):
            with attempt:
                raise ValueError("not retried")
