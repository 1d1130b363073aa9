"""Full garbage collections run between reconcile passes, never in the middle of one
(fleetd/gc_pacing.py)."""

from __future__ import annotations

import gc

from fleetd.gc_pacing import NEVER, GcPacing


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_automatic_full_collections_are_off_while_installed_and_restored_after() -> None:
    before = gc.get_threshold()
    pacing = GcPacing(every_s=60.0, clock=Clock())
    pacing.install()
    try:
        assert gc.get_threshold() == (before[0], before[1], NEVER)  # the young generations as before
    finally:
        pacing.uninstall()
    assert gc.get_threshold() == before


def test_a_full_collection_runs_after_a_pass_at_most_every_interval() -> None:
    clock = Clock()
    pacing = GcPacing(every_s=60.0, clock=clock)
    full: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            full.append(1)

    gc.callbacks.append(seen)
    pacing.install()
    try:
        pacing.after_pass()
        assert full == []  # not yet due
        clock.t = 61.0
        pacing.after_pass()
        assert len(full) == 1 and pacing.collections == 1
        clock.t = 100.0
        pacing.after_pass()
        assert len(full) == 1  # 39 s since the last: not due
        clock.t = 122.0
        pacing.after_pass()
        assert len(full) == 2
    finally:
        pacing.uninstall()
        gc.callbacks.remove(seen)
    pacing.after_pass()  # uninstalled: nothing
    assert pacing.collections == 2


def test_two_daemons_in_one_process_leave_the_thresholds_as_they_found_them() -> None:
    before = gc.get_threshold()
    a, b = GcPacing(clock=Clock()), GcPacing(clock=Clock())
    a.install()
    b.install()
    a.uninstall()  # the first one to go: the other still runs its passes
    assert gc.get_threshold()[2] == NEVER
    b.uninstall()
    assert gc.get_threshold() == before
