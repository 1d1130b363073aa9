"""Logs each leaving node's interruption phase (fleetd.protocol.interruption.Phase, read from its
keys by ``decide.Observation.phase``) once per move, not every steering pass (DESIGN.md "One
interruption, end to end")."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetd.protocol.interruption import Phase, reachable
from fleetd.rendezvous import decide
from fleetd.shared.logs import get_logger

log = get_logger(__name__)


@dataclass
class PhaseLog:
    phases: dict[str, Phase] = field(default_factory=dict)  # leaving nodes' phases, last pass

    def note(self, obs: decide.Observation) -> None:
        """The store shows only some phases, so a node may jump ahead; a move the table cannot
        reach means its keys were lost."""
        phases = {a: p for a in obs.in_phase(*Phase) if (p := obs.phase(a)) is not None}
        for addr, phase in sorted(phases.items()):
            was = self.phases.get(addr)
            if phase is was:
                continue
            if was is None or reachable(was, phase):
                log.info("interruption_phase", addr=addr, phase=str(phase), was=None if was is None else str(was))
            else:
                log.warning(
                    "interruption_phase",
                    addr=addr,
                    phase=str(phase),
                    was=str(was),
                    why="the store no longer shows a key it showed (a store restart?)",
                )
        self.phases = phases
