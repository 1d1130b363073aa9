"""The one retry schedule (shared by the controller and the agent): exponential from ``first_s``,
capped at ``max_s``, optionally jittered, reset after a success. Every reconnect, re-enrolment
and re-poll waits ``next_delay()`` between tries; the reason a loop gives up, if ever, is its own.

Jitter spreads 2,000 agents that lost the same broker over the reconnect window instead of
having them knock together; loops with one instance (the controller's) need none."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Backoff:
    first_s: float = 0.25
    max_s: float = 5.0
    jitter: float = 0.0  # each delay is scaled by a uniform factor in [1 - jitter, 1 + jitter]
    _next: float = 0.0  # the last delay before jitter; 0: none since the last reset

    def next_delay(self) -> float:
        self._next = self.first_s if self._next == 0 else min(self._next * 2, self.max_s)
        return self._next * random.uniform(1 - self.jitter, 1 + self.jitter) if self.jitter else self._next

    def reset(self) -> None:
        self._next = 0.0
