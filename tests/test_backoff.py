"""The one retry schedule (fleetd/shared/backoff.py) every reconnect and re-poll uses."""

from __future__ import annotations

from fleetd.shared.backoff import Backoff


def test_doubles_from_first_to_the_cap_and_starts_over_after_a_reset() -> None:
    b = Backoff(0.5, 3.0)
    assert [b.next_delay() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.reset()
    assert b.next_delay() == 0.5


def test_jitter_stays_inside_its_band_around_the_schedule() -> None:
    b = Backoff(1.0, 8.0, jitter=0.25)
    for expected in (1.0, 2.0, 4.0, 8.0, 8.0):
        assert expected * 0.75 <= b.next_delay() <= expected * 1.25
