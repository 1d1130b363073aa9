"""When fleetd last heard each member on its two independent channels, for decide.silent_everywhere.

The store channel is the member's torchrun heartbeat advancing (seen by the steering, stamped on
fleetd's clock, so a node's clock skew does not count); the broker channel is the newest message
from the member's agent (the registry, also fleetd's clock). A node that vanished or froze goes
quiet on both at once; a slow or half-cut node keeps speaking on one.

The watch also keeps the longest both-channel quiet it saw of a member not (yet) declared lost,
logged each time it grows past half of `loss.silent_after_s`. In a run with no loss that is the
margin a healthy node kept under the threshold: the false-positive measurement reads it
(docs/measurements/2026-11-silent-loss.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from fleetd.rendezvous.decide import Observation
from fleetd.shared.logs import get_logger

log = get_logger(__name__)
LOG_STEP_S = 0.25


@dataclass
class SilenceWatch:
    silent_after_s: float | None = None
    # Address -> when its agent last spoke through the broker (epoch seconds, fleetd's clock).
    broker_seen: Callable[[str], float | None] | None = None
    store_seen: dict[str, datetime] = field(default_factory=dict)
    peak_quiet_s: float = 0.0  # longest both-channel quiet of a member not declared lost
    _logged_peak_s: float = 0.0

    def heartbeat_advanced(self, addr: str, now: datetime) -> None:
        self.store_seen[addr] = now

    def observation(self, members: frozenset[str] | None) -> dict[str, Any]:
        """The Observation fields for decide.silent_everywhere; none when off."""
        if self.silent_after_s is None or self.broker_seen is None or not members:
            return {}
        broker = {a: datetime.fromtimestamp(t, UTC) for a in members if (t := self.broker_seen(a)) is not None}
        return {
            "silent_after": timedelta(seconds=self.silent_after_s),
            "store_seen": {a: self.store_seen[a] for a in members if a in self.store_seen},
            "broker_seen": broker,
        }

    def note_margin(self, obs: Observation, lost: frozenset[str]) -> None:
        """Track the longest both-channel quiet of members still counted alive."""
        both = obs.store_seen.keys() & obs.broker_seen.keys()
        quiet = [min(obs.now - obs.store_seen[a], obs.now - obs.broker_seen[a]).total_seconds() for a in both - lost]
        peak = max(quiet, default=0.0)
        # Logged from half the threshold up, in steps of LOG_STEP_S (a real loss ramps to the
        # threshold in 50 ms passes: a line each would be noise).
        if (
            self.silent_after_s is not None
            and peak >= self.silent_after_s / 2
            and peak >= self._logged_peak_s + LOG_STEP_S
        ):
            self._logged_peak_s = peak
            log.info("rendezvous_quiet_peak", quiet_s=round(peak, 2), silent_after_s=self.silent_after_s)
        self.peak_quiet_s = max(self.peak_quiet_s, peak)
