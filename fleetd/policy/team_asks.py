"""What a job asks of the team allocator beyond its configured size (pure; the simulator's team
replay and the control host's team loop both use these, fleetd/sim/team.py, fleetd/team/inputs.py):

- ``deadline_ask``: the nodes a deadline job needs to finish in time, the smallest size whose
  throughput covers the work left over the time left (less one changeover, the time new nodes take
  to train) with ``margin`` to spare; all of ``max_nodes`` when even that falls short.
- ``scaling_curve``: useful node-equivalents at 1, 2, ... nodes (``TeamJob.useful_nodes``) from the
  job's measured steps/s per world size: each size's throughput over one node's. One node's is
  measured, or the smallest measured size's per node (ideal scaling below it); a size between two
  measured ones is interpolated, and the curve stops at the largest measured size (the allocator
  reads a node past it as adding what the last one did).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from fleetd.policy.team_model import useful_at

DEADLINE_MARGIN = 1.1  # the pace asked is 10 % above what finishes exactly on time


def deadline_ask(
    left_steps: float,
    time_left_s: float,
    throughput: Callable[[int], float],
    max_nodes: int,
    margin: float = DEADLINE_MARGIN,
) -> int:
    """The smallest fleet that keeps the deadline (``throughput(n)``: steps/s at ``n`` nodes)."""
    rate = margin * max(0.0, left_steps) / max(1.0, time_left_s)
    return next((n for n in range(1, max_nodes + 1) if throughput(n) >= rate), max_nodes)


def scaling_curve(measured: Mapping[int, float]) -> tuple[float, ...]:
    """Useful node-equivalents at 1..largest measured size; () when nothing was measured."""
    sizes = _sizes(measured)
    if not sizes:
        return ()
    per_node = _per_node(measured, sizes)
    known = {0: 0.0, **{n: measured[n] / per_node for n in sizes}}
    points = sorted(known)
    curve = []
    for n in range(1, sizes[-1] + 1):
        if n in known:
            curve.append(known[n])
            continue
        lo = max(p for p in points if p < n)
        hi = min(p for p in points if p > n)
        curve.append(known[lo] + (known[hi] - known[lo]) * (n - lo) / (hi - lo))
    return tuple(curve)


def throughput_at(measured: Mapping[int, float], declared_per_node: float | None) -> Callable[[int], float] | None:
    """Steps/s at ``n`` nodes: the measured curve times one node's rate; without a measurement, the
    declared rate per node at ideal scaling. None when neither is known."""
    curve = scaling_curve(measured)
    if curve:
        per_node = _per_node(measured, _sizes(measured))
        return lambda n: per_node * useful_at(curve, n)
    if declared_per_node is not None and declared_per_node > 0:
        return lambda n: declared_per_node * n
    return None


def _sizes(measured: Mapping[int, float]) -> list[int]:
    return sorted(n for n, r in measured.items() if n >= 1 and r > 0)


def _per_node(measured: Mapping[int, float], sizes: list[int]) -> float:
    """One node's pace: measured, else the smallest measured size's per node."""
    return measured[1] if sizes[0] == 1 else measured[sizes[0]] / sizes[0]
