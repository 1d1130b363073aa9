"""When a demo has told its story (pure: the trainers' progress in, a time out).

A scenario such as ``storm`` or a ``--trace`` plays interruptions into a job that never finishes.
Its story has played once every scripted step has run and AWS has reclaimed every noticed node;
``scaling``'s, once fleetd released the node not worth its price (fleetd/demo/runner.py notes
either moment as ``played_at``, with the fleet's size then). It is told when, after that, the
whole fleet trains: every rank of a world of that size has completed a step (the replacements
restored and joined). The demo then shows ``SETTLE_S`` more of steady training and ends; training
on to ``--duration`` shows nothing new and, in CI, costs minutes per scenario. A story not told by
then runs up to ``OVERTIME_S`` longer (a slow box), and the report says whether it was told.
"""

from __future__ import annotations

from fleetd.demo.progress import Progress

# Steady training shown after the fleet is whole again (a few steps at the toy's pace on a loaded
# box), so the report's last world change has steps after it.
SETTLE_S = 10.0
# How long past its --duration a story not told yet may still run. The duration places the
# story's events (a --trace is spread over it) and the fleet then needs its replacements booted
# and joined: beside two CPU burners and a test worker, a trace wave's last replacement joined at
# 81 s of a 90 s duration, and the demo stopped 1 s before its settle ended, untold. A story told
# in time ends when told, so this costs nothing there.
OVERTIME_S = 120.0


def training_cap_s(duration_s: float, end_when_told: bool) -> float:
    """The training time after which the demo stops, told or not."""
    return duration_s + (OVERTIME_S if end_when_told else 0.0)


def told_at(progress: Progress, played_at: float, fleet_size: int) -> float | None:
    """When the story will have been told, or None while the fleet is not whole again after
    ``played_at`` (the job's code reports no steps: never, the demo runs to its duration)."""
    whole = progress.training_again_at(played_at, world=fleet_size)
    return None if whole is None else whole + SETTLE_S
