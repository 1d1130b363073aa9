"""Deadline awareness for fleetd's policy in the simulator (single-node deadline jobs)."""

from __future__ import annotations

from fleetd.config import FleetdConfig
from fleetd.sim.engine import World


class DeadlineGuard:
    """Deadline awareness for a single-node job, expressed through the planner's inputs.

    The planner has no notion of a deadline yet, so the simulator feeds Can't Be Late's uniform
    progress rule into the knobs the planner already has:
    - ``capacity.spot_wait_s``: wait for spot only while the job is ahead of the progress line
      C x t / D (when idle it falls behind at t = done x D / C; then fall back to on-demand);
    - inside the safety margin (remaining time < remaining work + 2d) spot is not offered, so
      the job finishes on on-demand without risking another changeover.
    Proposed for fleetd/policy: a `deadline` in the job config and this rule in the planner.
    """

    def __init__(self, deadline_s: float, changeover_s: float) -> None:
        self.deadline_s = deadline_s
        self.d = changeover_s

    def _work(self, world: World) -> tuple[float, float, float]:
        """(total, done, remaining) work in seconds on one node."""
        rate = world.job.throughput(1)
        return world.job.total_steps / rate, world.progress / rate, world.remaining_steps / rate

    def _behind_at(self, world: World) -> float:
        total, done, _ = self._work(world)
        return done * self.deadline_s / total

    def _safety_at(self, world: World) -> float:
        _, _, remaining = self._work(world)
        return self.deadline_s - remaining - 2 * self.d

    def adjust(
        self, world: World, cfg: FleetdConfig, spot_unavailable_since: float | None
    ) -> tuple[FleetdConfig, bool]:
        now = world.now
        if now >= self._safety_at(world):
            wait, hide_spot = 0.0, True
        else:
            base = spot_unavailable_since if spot_unavailable_since is not None else now
            wait, hide_spot = max(0.0, self._behind_at(world) - base), False
        capacity = cfg.capacity.model_copy(update={"spot_wait_s": wait})
        return cfg.model_copy(update={"capacity": capacity}), hide_spot

    def wake_times(self, world: World) -> list[float]:
        return [self._behind_at(world) + 1e-3, self._safety_at(world) + 1e-3]
