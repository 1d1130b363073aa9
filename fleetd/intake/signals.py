"""Fleet-wide training signals for the planner, folded from what the agents report.

- Throughput per node count, measured from the job's real progress: while the world size the
  nodes report stays the same (an "epoch"), the job's rate is the steps it advanced between the
  epoch's first report and the newest, over the time between their arrivals (not between two
  reconcile passes, which a loaded host delays), once that window is MIN_WINDOW_S long. An epoch starts
  with the first report of the new size, so the re-form pause (checkpoint, rendezvous, restart)
  is not counted against the size, and a one-off sample cannot decide: the window is the
  smoothing. Epochs at a size seen before are blended with what was measured then, so the
  map remembers each size the job has run at (the scaling policy compares them).
- The newest durable checkpoint: a ``checkpoint-uploaded`` event whose manifest is complete.
- The last checkpoint request fleetd made (the commander notes it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import MappingProxyType

from fleetd.intake.registry import TELEMETRY_FRESH_S, NodeRegistry
from fleetd.policy.observation import DesiredJob
from fleetd.protocol.messages import CheckpointUploaded
from fleetd.reconcile.ports import FleetSignals

FRESH_S = TELEMETRY_FRESH_S  # telemetry older than this no longer describes the job
MIN_WINDOW_S = 15.0  # an epoch's rate counts once it spans this long
SMOOTHING = 0.5  # weight of this epoch's rate against earlier epochs at the same size


class TrainingSignals:
    """The reconcile loop's SignalSource, fed by the node registry (in memory, no I/O)."""

    def __init__(self, registry: NodeRegistry, nproc_per_node: int = 1, clock: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.nproc_per_node = max(1, nproc_per_node)
        self.clock = clock
        self._rate_by_nodes: dict[int, float] = {}
        self._before_epoch: dict[int, float] = {}  # per size: the rate measured by earlier epochs
        self._epoch: tuple[int, float, int] | None = None  # (nodes, started_at, step then)
        self.durable_step: int | None = None
        self.durable_at: float | None = None
        self.checkpoint_request_at: float | None = None
        self.stop_completed_at: float | None = None
        self.desired_job = DesiredJob.RUN
        self.code_digest = ""  # the job's code version now: the daemon sets it (wiring.py, a submit)

    def note_checkpoint_request(self, at: float) -> None:
        self.checkpoint_request_at = at

    def note_stop_completed(self, at: float | None) -> None:
        """The stop sequence ended at ``at`` (None: a resume undid the stop)."""
        self.stop_completed_at = at

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
            code_digest=self.code_digest,
            stop_completed_at=self.stop_completed_at,
        )

    def _sample_throughput(self, now: float) -> None:
        by_world: dict[int, list[tuple[int, float]]] = {}  # world size -> (step, when it arrived)
        for rec in self.registry.records():
            tel = rec.telemetry
            if (
                tel is None
                or rec.telemetry_at is None
                or now - rec.telemetry_at > FRESH_S
                or tel.step is None
                or not tel.world_size
            ):
                continue
            by_world.setdefault(tel.world_size, []).append((tel.step, rec.telemetry_at))
        if not by_world:
            return
        # Mid-change, reports disagree on the world size: trust the one most nodes report.
        world, steps = max(by_world.items(), key=lambda kv: (len(kv[1]), kv[0]))
        nodes = max(1, world // self.nproc_per_node)
        # Synchronous job: every rank is within a step of the others; the newest report says
        # where the job is, and when. Timing the step by its arrival, not by this pass, keeps a
        # pass that runs late (a loaded host) from crediting the epoch with steps from before it.
        step, at = max(steps)
        epoch = self._epoch
        if epoch is None or epoch[0] != nodes or step < epoch[2]:
            # A new world size (or a resume from an older step): a new measurement window.
            self._epoch = (nodes, at, step)
            if nodes in self._rate_by_nodes:
                self._before_epoch[nodes] = self._rate_by_nodes[nodes]
            else:
                self._before_epoch.pop(nodes, None)
            return
        _, started, first = epoch
        if at - started < MIN_WINDOW_S:
            return
        rate = (step - first) / (at - started)
        old = self._before_epoch.get(nodes)
        self._rate_by_nodes[nodes] = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate
