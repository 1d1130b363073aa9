"""The training job being simulated: how much work, how fast at each size, what recovery costs.

Work is counted in steps. A node trains ``steps_per_node_s`` steps per second alone; ``w`` nodes
train ``w x steps_per_node_s x efficiency(w)`` where efficiency falls by a constant factor per
doubling of nodes (data-parallel communication overhead). Work can also be given in GPU-hours at
one node's pace (`JobSpec.from_gpu_hours`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from fleetd.sim import defaults as d


@dataclass(frozen=True, slots=True)
class JobSpec:
    total_steps: float
    steps_per_node_s: float = 1.0
    scaling_efficiency_per_doubling: float = d.SCALING_EFFICIENCY_PER_DOUBLING.value
    min_nodes: int = 1
    max_nodes: int = 1
    # Seconds every rank is paused while a checkpoint is written locally.
    checkpoint_stall_s: float = d.CHECKPOINT_STALL_S.value
    checkpoint_gb: float = 10.0  # size of one checkpoint in S3 (for the S3 cost)
    # Periodic checkpoint interval of jobs run without fleetd.
    periodic_checkpoint_s: float = d.PERIODIC_CHECKPOINT_S.value
    deadline_s: float | None = None  # from the job's start
    notice_lead_s: float = d.NOTICE_LEAD_S.value
    no_notice_share: float = d.NO_NOTICE_SHARE.value  # losses that come with no notice at all

    def __post_init__(self) -> None:
        if not self.total_steps > 0 or not self.steps_per_node_s > 0:
            raise ValueError("total work and per-node throughput must be positive")
        if not 0 < self.scaling_efficiency_per_doubling <= 1:
            raise ValueError("scaling efficiency per doubling must be in (0, 1]")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError("need 1 <= min_nodes <= max_nodes")
        if not 0 <= self.no_notice_share <= 1:
            raise ValueError("no-notice share must be in [0, 1]")
        if self.checkpoint_stall_s < 0 or self.periodic_checkpoint_s <= 0:
            raise ValueError("checkpoint stall must be >= 0 and the interval > 0")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ValueError("deadline must be positive")

    @classmethod
    def from_gpu_hours(
        cls, gpu_hours: float, gpus_per_node: int = 1, steps_per_node_s: float = 1.0, **kw: Any
    ) -> JobSpec:
        node_seconds = gpu_hours * 3600.0 / gpus_per_node
        return cls(total_steps=node_seconds * steps_per_node_s, steps_per_node_s=steps_per_node_s, **kw)

    def efficiency(self, nodes: int) -> float:
        if nodes <= 1:
            return 1.0
        eff: float = self.scaling_efficiency_per_doubling ** math.log2(nodes)
        return eff

    def throughput(self, nodes: int) -> float:
        """Steps per second with ``nodes`` nodes training."""
        return nodes * self.steps_per_node_s * self.efficiency(nodes) if nodes > 0 else 0.0

    def with_(self, **changes: Any) -> JobSpec:
        return replace(self, **changes)
