"""The steering loop's settings (fleetd/rendezvous/steering.py), from fleetd.toml [loss] and
[rendezvous] in the daemon, from flags in ``steer_main``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SteerSettings:
    min_nodes: int = 1
    max_nodes: int = 1 << 30
    interval_s: float = 0.05  # one pass is one batch of local round trips; survivors wait on it
    left_timeout_s: float = 5.0
    # A member whose heartbeat is this stale is removed once the job also made no progress for
    # hang_after_s (decide.py). fleetd.toml [loss]; measured: docs/measurements/2026-11-partitions.md.
    dead_after_s: float = 6.0
    # After a store restart, hold the first round open this long for the nodes that trained
    # before it (they restart torchrun seconds apart).
    restart_hold_s: float = 30.0
    coalesce_s: float = 3.0  # a wave's leavers re-form the survivors once (decide.Observation)
    full_scan_s: float = 1.0  # drain keys are re-read at least this often even if no key appeared
    hang_after_s: float = 10.0
