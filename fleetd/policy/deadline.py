"""Deadlines: spot, on-demand or wait, from progress, deadline, throughput and changeover (pure).

The rule is Uniform Progress (UP) from "Can't Be Late" (Wu et al., NSDI'24), for one node or a
fleet, with its safety net:

- the progress line: by time t a job that started at t0 and is due at D should have done
  C x (t - t0) / (D - t0) of its C steps;
- behind the line and short of nodes: buy on-demand now (no waiting for spot);
- ahead of the line: spot only, wait for it; on-demand nodes already running stay until the job
  is ahead of the line 2d later (hysteresis: cp >= ep(t + 2d)), then they go (back to spot if it
  is offered, else idle until spot returns or the job falls behind again);
- safety net: when the fleet is not full on spot and the time left is less than the work left
  at the target size plus 2d (d: the changeover, buying a node until it trains), finish on
  on-demand: no new spot, no return to spot. The condition holds once met (on-demand work
  shrinks time left and work left alike), so the planner needs no memory of it.

UP's guarantee (no miss when the work fits the deadline with 2d to spare) carries over because
fleetd keeps every UP condition. fleetd adds what the planner does anyway: a changeover to
spot is make-before-break (the on-demand node trains while the spot node boots), a notice
starts the replacement up to 2 minutes before the loss, and a fleet keeps training at a smaller
size while one node is replaced.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

_EPS_S = 1e-3


@dataclass(frozen=True, slots=True)
class DeadlineInputs:
    deadline_at: float  # on the planner's clock
    started_at: float  # the progress line's start
    total_steps: float
    done_steps: float
    # Steps per second at the target size (measured or a conservative estimate); None: unknown
    # (nothing has trained yet), and then only the line decides.
    steps_per_s: float | None
    changeover_s: float
    full_on_spot: bool  # the target size is training on spot now: nothing to replace


@dataclass(frozen=True, slots=True)
class DeadlineCall:
    """What the deadline asks of this pass."""

    on_demand_now: bool  # fill a shortfall with on-demand at once (no spot_wait_s)
    spot_allowed: bool  # new spot nodes may be bought (False inside the safety net)
    # Ahead of the line 2d from now: running on-demand nodes are not needed (back to spot, or
    # idle until spot returns or the job falls behind again).
    on_demand_not_needed: bool
    safety_net: bool
    reason: str
    # Times at which the call may change if nothing else happens (for the simulator's wake-ups;
    # the daemon passes every reconcile interval anyway).
    wake_at: tuple[float, ...] = ()


def expected_steps(i: DeadlineInputs, t: float) -> float:
    """ep(t): steps done by t on the line from (started_at, 0) to (deadline_at, total)."""
    span = max(i.deadline_at - i.started_at, _EPS_S)
    return i.total_steps * min(1.0, max(0.0, (t - i.started_at) / span))


def decide(i: DeadlineInputs, now: float) -> DeadlineCall:
    remaining = max(0.0, i.total_steps - i.done_steps)
    d = i.changeover_s
    time_left = i.deadline_at - now
    if remaining <= 0:
        return DeadlineCall(False, True, True, False, "deadline job: all work done")
    work_left_s = remaining / i.steps_per_s if i.steps_per_s else None
    line = expected_steps(i, now)
    progress = f"{i.done_steps:,.0f} of {i.total_steps:,.0f} steps, line {line:,.0f}"
    wake = _wake_times(i, now, work_left_s)
    if work_left_s is not None and not i.full_on_spot and time_left < work_left_s + 2 * d:
        return DeadlineCall(
            True, False, False, True,
            f"deadline safety net: {time_left / 3600:.2f} h left < {work_left_s / 3600:.2f} h of work + "
            f"2 x changeover {d:.0f} s ({progress}): finishing on on-demand",
            wake,
        )
    if i.done_steps < line - 1e-9:
        return DeadlineCall(
            True, True, False, False,
            f"deadline: behind the uniform-progress line ({progress}): on-demand for any shortfall",
            wake,
        )
    ahead_2d = i.done_steps >= expected_steps(i, now + 2 * d) - 1e-9
    why = "2 x changeover ahead" if ahead_2d else "ahead, within 2 x changeover (on-demand stays)"
    return DeadlineCall(
        False, True, ahead_2d, False, f"deadline: {why} of the uniform-progress line ({progress}): spot only", wake
    )


def _wake_times(i: DeadlineInputs, now: float, work_left_s: float | None) -> tuple[float, ...]:
    """When an idle job falls behind the line, and when its safety net begins."""
    out = []
    span = max(i.deadline_at - i.started_at, _EPS_S)
    behind_at = i.started_at + span * i.done_steps / i.total_steps
    out.append(behind_at + _EPS_S)
    if work_left_s is not None:
        out.append(i.deadline_at - work_left_s - 2 * i.changeover_s + _EPS_S)
    return tuple(t for t in out if t > now and math.isfinite(t))


def steps_per_s_at(throughput_by_nodes: Mapping[int, float], nodes: int) -> float | None:
    """Throughput at ``nodes`` from what was measured, never above it: the measured value, else
    the best of the lower bounds (a smaller fleet's rate; a larger fleet's rate per node times
    ``nodes``, as adding nodes never raises the rate per node). None when nothing was measured."""
    if nodes <= 0:
        return None
    exact = throughput_by_nodes.get(nodes)
    if exact is not None and exact > 0:
        return exact
    bounds = [r for n, r in throughput_by_nodes.items() if 0 < n < nodes and r > 0]
    bounds += [r * nodes / n for n, r in throughput_by_nodes.items() if n > nodes and r > 0]
    return max(bounds) if bounds else None
