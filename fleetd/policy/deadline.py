"""Deadlines: spot, on-demand or wait, from progress, deadline, throughput and changeover (pure).

Uniform Progress from "Can't Be Late" (NSDI'24) for one node or a fleet: behind the progress line
C x (t - t0) / (D - t0), on-demand for the shortfall; ahead, spot only, with on-demand nodes kept
until the job is 2d x m / N ahead (``on_demand_keep``); near the end the safety net finishes on
on-demand, swapping to spot make-before-break only while the slack covers it (``stall_budget_s``).
Only the net keeps the deadline; the line and the hysteresis decide cost (docs/DESIGN.md
"Placement and deadlines", "The no-miss guarantee"; sweeps: docs/measurements/2026-11-deadline.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

_EPS_S = 1e-3
# Slack kept beyond losing every spot node (d) before a safety-net swap to spot: a quarter
# changeover, for re-forms, pass latency and a loss without notice (detected ~20 s late).
SWAP_RESERVE = 0.25


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
    nodes: int = 1  # the target size
    # Nothing trains yet and nodes are booting: seconds until the first can train (counted as
    # work left, as UP counts a pending changeover).
    pending_s: float = 0.0
    on_demand_nodes: int = 0  # of the target, on on-demand now (running or booting)
    spot_training: int = 0  # spot nodes training now
    # Seconds every member stops for one membership change (coordinated checkpoint + re-form):
    # the stall budget a safety-net swap keeps (stall_budget_s) on top of d and the reserve.
    membership_stall_s: float = 0.0


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
    # Inside the safety net: on-demand nodes may still be swapped for spot make-before-break
    # (the on-demand node trains until the spot node has joined, so the swap itself costs no
    # time); a later loss of the spot nodes (a wave may take all) costs up to d of the fleet's time, and the slack
    # keeps that plus a quarter changeover in reserve.
    swap_to_spot: bool = False
    # Time left minus work left at the target size (None: throughput not measured yet).
    slack_s: float | None = None
    changeover_s: float = 0.0
    # The membership changes a swap and the losses after it can cause (stall_budget_s).
    stall_budget_s: float = 0.0
    # A fleet ahead of the line (on_demand_not_needed): how many on-demand nodes to keep so that
    # they and the spot nodes training now still keep the line's pace. The others go; these go
    # back to spot make-before-break once spot is offered.
    on_demand_keep: int = 0

    def can_wait_s(self, wait_s: float, idle_share: float = 1.0, latency_s: float = 0.0) -> bool:
        """Whether the job can wait ``wait_s`` (for a spot pool's reclaim wave to pass) before
        buying. Inside the safety net: while a changeover, the reserve and the stalls are left
        after the wait. Outside it: while the first pass after the wait (``latency_s`` later at
        most: the reconcile interval) still finds the job outside the net, since the net finishes
        the job on on-demand. (Waiting out a 2-minute wave with exactly 2d + 120 s of slack did
        that: 5 h on on-demand, where spot bought in the wave's pool lasted to the end;
        bench/deadline.py, g4dn, one node, d = 0.3 h.) ``idle_share``: the share of the target
        missing while waiting outside the net (k of N nodes missing cost k/N of each second,
        assumption A2 of the proof)."""
        if self.slack_s is None:
            return not self.safety_net
        if self.safety_net:
            return self.slack_s >= wait_s + self.changeover_s * (1 + SWAP_RESERVE) + self.stall_budget_s
        lost = (wait_s + latency_s) * min(1.0, max(0.0, idle_share))
        return self.slack_s - lost >= 2 * self.changeover_s


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
    work_left_s = remaining / i.steps_per_s + i.pending_s if i.steps_per_s else None
    line = expected_steps(i, now)
    progress = f"{i.done_steps:,.0f} of {i.total_steps:,.0f} steps, line {line:,.0f}"
    wake = _wake_times(i, now, work_left_s)
    slack = None if work_left_s is None else time_left - work_left_s
    stalls = stall_budget_s(i)
    # A make-before-break swap to spot keeps slack for losing every spot node again (d), a reserve
    # and the re-forms it and those losses cause (DESIGN.md "The no-miss guarantee", step 3).
    swap_fits = slack is not None and slack >= d + SWAP_RESERVE * d + stalls
    # Once met the net's condition holds (on-demand work shrinks time left and work left alike),
    # so the planner needs no memory of it.
    if work_left_s is not None and not i.full_on_spot and time_left < work_left_s + 2 * d:
        swap = swap_fits
        return DeadlineCall(
            True,
            False,
            False,
            True,
            f"deadline safety net: {time_left / 3600:.2f} h left < {work_left_s / 3600:.2f} h of work + "
            f"2 x changeover {d:.0f} s ({progress}): finishing on on-demand"
            + (" (swapping to spot make-before-break while the slack allows)" if swap else ""),
            wake,
            swap_to_spot=swap,
            slack_s=slack,
            changeover_s=d,
            stall_budget_s=stalls,
        )
    # Outside the net one node on on-demand goes back to spot make-before-break whenever spot is
    # offered (it trains while the spot node boots): the net's swap test, and 2d left after the
    # swap's own join and drain (the proof's step 1: outside the net S >= 2d).
    # One node only: a fleet swapping every on-demand node into a pool that offers spot between
    # reclaim waves paid more (bench/deadline.py, 4 and 8 nodes: up to +9 % per useful step) and
    # keeps its own rule (on_demand_keep, back to spot once 2d x m / N ahead).
    swap = swap_fits and i.nodes <= 1 and slack is not None and slack >= 2 * d + 2 * i.membership_stall_s
    if i.done_steps < line - 1e-9:
        return DeadlineCall(
            True,
            True,
            False,
            False,
            f"deadline: behind the uniform-progress line ({progress}): on-demand for any shortfall"
            + ("; back to spot make-before-break once spot is offered" if swap and i.on_demand_nodes else ""),
            wake,
            swap_to_spot=swap,
            slack_s=slack,
            changeover_s=d,
            stall_budget_s=stalls,
        )
    margin = hysteresis_s(i)
    ahead_2d = i.done_steps >= expected_steps(i, now + margin) - 1e-9
    share = f" x {min(i.on_demand_nodes, i.nodes)}/{i.nodes} on-demand nodes" if i.nodes > 1 else ""
    why = f"2 x changeover{share} ahead" if ahead_2d else f"ahead, within 2 x changeover{share} (on-demand stays)"
    keep = on_demand_to_keep(i) if ahead_2d else 0
    if keep:
        why += f"; keeping {keep} on-demand node(s) to hold the line's pace with {i.spot_training} on spot"
    if not ahead_2d and swap and i.on_demand_nodes:
        why += "; back to spot make-before-break once spot is offered"
    return DeadlineCall(
        False,
        True,
        ahead_2d,
        False,
        f"deadline: {why} of the uniform-progress line ({progress}): spot only",
        wake,
        on_demand_keep=keep,
        swap_to_spot=swap and not ahead_2d,
        slack_s=slack,
        changeover_s=d,
        stall_budget_s=stalls,
    )


def stall_budget_s(i: DeadlineInputs) -> float:
    """Stalls a safety-net swap must leave slack for (DESIGN.md "The no-miss guarantee"): the
    swap's own join and drain (2), then each of at most N spot members lost once, each loss a
    leave and a replacement's join (2 N): 2 (N + 1) membership changes of ``membership_stall_s``.
    Without it the quarter-changeover reserve alone had to absorb them, which at d = 0.05 h and 8
    nodes (a 45 s reserve, 90 s of re-forms) the proof could not cover."""
    return 2 * (max(1, i.nodes) + 1) * i.membership_stall_s


def on_demand_to_keep(i: DeadlineInputs) -> int:
    """A fleet's on-demand nodes that, beside the spot nodes training now, hold the line's pace
    (total / span) in whole nodes: the pace in nodes' worth, at the target's rate per node
    (which errs low), rounded down. The fractional remainder is left to UP's cycle, as UP does
    for one node (the job falls behind, buys, gets the lead, releases): rounding up kept one
    on-demand node too many for the whole job (2 nodes at a pace of 1.33: the spot node's time
    went unused and the job finished hours early on on-demand). One node: 0 (UP idles it)."""
    if i.nodes <= 1 or not i.steps_per_s or i.on_demand_nodes <= 0:
        return 0
    span = max(i.deadline_at - i.started_at, _EPS_S)
    per_node = i.steps_per_s / i.nodes
    need = math.floor(i.total_steps / span / per_node + 1e-9)
    return max(0, min(i.on_demand_nodes, need - i.spot_training))


def hysteresis_s(i: DeadlineInputs) -> float:
    """The lead on-demand nodes wait for before they go: two changeovers of the nodes that
    change over (m of N; m = N, or no on-demand node, gives UP's 2d)."""
    m = min(i.on_demand_nodes, i.nodes)
    share = m / i.nodes if i.nodes > 1 and m > 0 else 1.0
    return 2 * i.changeover_s * share


def _wake_times(i: DeadlineInputs, now: float, work_left_s: float | None) -> tuple[float, ...]:
    """When an idle job falls behind the line, when its safety net begins, and when a job
    training at the target pace gets 2d ahead of the line."""
    out = []
    span = max(i.deadline_at - i.started_at, _EPS_S)
    behind_at = i.started_at + span * i.done_steps / i.total_steps
    out.append(behind_at + _EPS_S)
    if work_left_s is not None and i.pending_s <= 0:
        # (While the first nodes boot, pending_s shrinks as fast as the time left: the slack
        # stands still and the crossing never comes by waiting; the boot's end wakes a pass.)
        out.append(i.deadline_at - work_left_s - 2 * i.changeover_s + _EPS_S)
    k = i.total_steps / span  # the line's pace
    r = i.steps_per_s or 0.0
    if r > k:  # training at the target pace: when it gets the hysteresis lead (on-demand can go)
        out.append((k * (hysteresis_s(i) - i.started_at) + r * now - i.done_steps) / (r - k) + _EPS_S)
    return tuple(t for t in out if t > now and math.isfinite(t))


# Share of per-node throughput kept per doubling of nodes, assumed when extrapolating from a
# smaller fleet: below the ~0.95 data-parallel jobs typically keep (defaults.py in the simulator),
# so the estimate errs towards more work left (an earlier safety net, not a miss).
ASSUMED_EFFICIENCY_PER_DOUBLING = 0.9


def steps_per_s_at(throughput_by_nodes: Mapping[int, float], nodes: int) -> float | None:
    """Throughput at ``nodes`` from what was measured: the measured value; else from the
    nearest smaller fleet, scaled by size with ASSUMED_EFFICIENCY_PER_DOUBLING per doubling;
    else from a larger fleet's rate per node times ``nodes`` (adding nodes never raises the rate
    per node, so this errs low). None when nothing was measured."""
    if nodes <= 0:
        return None
    exact = throughput_by_nodes.get(nodes)
    if exact is not None and exact > 0:
        return exact
    smaller = [(n, r) for n, r in throughput_by_nodes.items() if 0 < n < nodes and r > 0]
    if smaller:
        n, r = max(smaller)
        scaled: float = r * nodes / n * ASSUMED_EFFICIENCY_PER_DOUBLING ** math.log2(nodes / n)
        return scaled
    larger = [r * nodes / n for n, r in throughput_by_nodes.items() if n > nodes and r > 0]
    return max(larger) if larger else None
