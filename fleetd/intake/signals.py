"""Fleet-wide training signals for the planner, folded from what the agents report.

- Throughput per node count: the job is synchronous, so every node reports the same steps/s;
  the median of fresh reports is the job's rate at the world size they report. A slow moving
  average per node count smooths noise, and remembers each size the job has run at (the
  scaling policy compares them).
- The newest durable checkpoint: a ``checkpoint-uploaded`` event whose manifest is complete.
- The last checkpoint request fleetd made (the commander notes it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from types import MappingProxyType

from fleetd.intake.registry import TELEMETRY_FRESH_S, NodeRegistry
from fleetd.policy.observation import DesiredJob
from fleetd.protocol.messages import CheckpointUploaded
from fleetd.reconcile.ports import FleetSignals

FRESH_S = TELEMETRY_FRESH_S  # telemetry older than this no longer describes the job
SMOOTHING = 0.3  # weight of a new sample in the per-size moving average


class TrainingSignals:
    """The reconcile loop's SignalSource, fed by the node registry (in memory, no I/O)."""

    def __init__(self, registry: NodeRegistry, nproc_per_node: int = 1,
                 clock: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.nproc_per_node = max(1, nproc_per_node)
        self.clock = clock
        self._rate_by_nodes: dict[int, float] = {}
        self.durable_step: int | None = None
        self.durable_at: float | None = None
        self.checkpoint_request_at: float | None = None
        self.desired_job = DesiredJob.RUN

    def note_checkpoint_request(self, at: float) -> None:
        self.checkpoint_request_at = at

    def snapshot(self) -> FleetSignals:
        for event in self.registry.drain_training_events():
            msg = event.message
            if isinstance(msg, CheckpointUploaded) and msg.complete:
                if self.durable_step is None or msg.step >= self.durable_step:
                    self.durable_step, self.durable_at = msg.step, event.received_at
        self._sample_throughput(self.clock())
        return FleetSignals(
            throughput_by_nodes=MappingProxyType(dict(self._rate_by_nodes)),
            last_durable_checkpoint_step=self.durable_step,
            last_durable_checkpoint_at=self.durable_at,
            last_checkpoint_request_at=self.checkpoint_request_at,
            desired_job=self.desired_job,
        )

    def _sample_throughput(self, now: float) -> None:
        by_world: dict[int, list[float]] = {}
        for rec in self.registry.records():
            tel = rec.telemetry
            if (tel is None or rec.telemetry_at is None or now - rec.telemetry_at > FRESH_S
                    or tel.steps_per_s is None or not tel.world_size):
                continue
            by_world.setdefault(tel.world_size, []).append(tel.steps_per_s)
        if not by_world:
            return
        # Mid-change, reports disagree on the world size: trust the one most nodes report.
        world, rates = max(by_world.items(), key=lambda kv: len(kv[1]))
        nodes = max(1, world // self.nproc_per_node)
        rate = statistics.median(rates)
        old = self._rate_by_nodes.get(nodes)
        self._rate_by_nodes[nodes] = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate
