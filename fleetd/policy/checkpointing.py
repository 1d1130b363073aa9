"""Periodic checkpoints sized to the fleet's own losses without notice (Young/Daly).

A loss with a notice costs no work: fleetd checkpoints before the node leaves. After a loss
without one (AWS's notice is best effort), data-parallel survivors save the step they completed
(agent/trainer/salvage.py), but sharded state, or a loss that takes every rank at once, rolls the
job back to the last durable checkpoint. For those, fleetd can keep that checkpoint younger
than Young/Daly's first-order optimum interval, sqrt(2 x delta x MTBF), where MTBF is the
fleet's mean time between losses without notice: this fleet's measured rate per node-hour
(PoolStats.losses / node_hours) times the nodes training. Every membership change also checkpoints, so in a busy fleet this rarely adds any.
No loss seen yet: no periodic checkpoints (the rate is unknown, and guessing costs stalls).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from fleetd.policy.model import RequestCheckpoint
from fleetd.policy.observation import PoolStats


def young_daly_interval_s(checkpoint_stall_s: float, mtbf_s: float) -> float:
    """Young/Daly's first-order optimum checkpoint interval: sqrt(2 x delta x MTBF).

    It balances the stall paid per checkpoint (delta / interval) against the work redone after
    a failure (interval / 2 per failure on average). Infinite MTBF means "never needed".
    """
    if checkpoint_stall_s < 0 or mtbf_s <= 0:
        raise ValueError("checkpoint stall must be >= 0 and MTBF > 0")
    if math.isinf(mtbf_s):
        return math.inf
    return math.sqrt(2.0 * checkpoint_stall_s * mtbf_s)


@dataclass(frozen=True, slots=True)
class Cadence:
    interval_s: float  # math.inf: no periodic checkpoint needed
    why: str


def cadence(stats: Iterable[PoolStats], training_nodes: int, checkpoint_stall_s: float) -> Cadence:
    """The checkpoint interval for ``training_nodes`` given this fleet's loss history."""
    stats = tuple(stats)
    losses = sum(s.losses for s in stats)
    node_hours = sum(s.node_hours for s in stats)
    if losses == 0 or node_hours <= 0 or training_nodes <= 0:
        return Cadence(math.inf, f"no loss without notice in {node_hours:.1f} node-h")
    mtbf_s = 3600.0 * node_hours / (losses * training_nodes)
    interval = young_daly_interval_s(checkpoint_stall_s, mtbf_s)
    return Cadence(
        interval,
        f"{losses} losses without notice in {node_hours:.1f} node-h, {training_nodes} nodes "
        f"training: one every {mtbf_s:.0f} s; Young/Daly sqrt(2 x {checkpoint_stall_s:g} s x "
        f"{mtbf_s:.0f} s) = {interval:.0f} s",
    )


def periodic_checkpoint(
    c: Cadence,
    *,
    last_durable_at: float | None,
    last_request_at: float | None,
    retry_s: float,
    now: float,
) -> tuple[RequestCheckpoint | None, str]:
    """A checkpoint request when the last durable checkpoint is older than the cadence."""
    if math.isinf(c.interval_s):
        return None, ""
    if last_durable_at is not None and now - last_durable_at <= c.interval_s:
        return None, ""
    if last_request_at is not None and now - last_request_at < min(retry_s, c.interval_s):
        return None, f"periodic checkpoint requested {now - last_request_at:.0f} s ago, waiting for it"
    age = (
        "none is durable yet"
        if last_durable_at is None
        else (f"the last durable one is {now - last_durable_at:.0f} s old")
    )
    return RequestCheckpoint(reason=f"periodic checkpoint: {c.why}; {age}"), ""
