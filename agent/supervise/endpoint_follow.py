"""Which rendezvous store torchrun should use, once the leading controller says where it is.

After a control-host failover the new leader starts its own rendezvous store and publishes its
endpoint, retained, on ``fleetd/<fleet>/rendezvous`` (fleetd/ha/endpoint.py). The agent starts
from the address in its config; :func:`follow` decides, from plain data, whether an advertised
endpoint moves torchrun to a new store. Pure: no I/O, no clock, so the unit tests exercise the
same rules the agent runs (the agent then restarts torchrun by the store-restart path).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from fleetd.protocol.messages import RendezvousEndpoint


@dataclass(frozen=True, slots=True)
class StoreEndpoint:
    """Where torchrun's store is now; ``generation`` is None until a leader has advertised one
    (the address came from the agent's config)."""

    host: str
    port: int
    generation: int | None = None


class FollowAction(StrEnum):
    RESTART = "restart"  # a new store: restart torchrun against it
    ADOPT = "adopt"  # same host:port, newer leader: remember its generation, torchrun keeps running
    STALE = "stale"  # not newer than what we follow (a redelivered retained message, an old leader)
    OTHER_RUN = "other-run"  # another job's store: never follow it


@dataclass(frozen=True, slots=True)
class FollowDecision:
    action: FollowAction
    endpoint: StoreEndpoint  # what the agent follows after this message


def follow(current: StoreEndpoint, advertised: RendezvousEndpoint, run_id: str) -> FollowDecision:
    """One advertised endpoint against the one torchrun uses. A generation (the leader's lease
    generation) must be strictly newer to count, so each change restarts torchrun once, however
    often the retained message is delivered again (every reconnect), and a deposed leader's late
    message cannot move the job back."""
    if advertised.run_id != run_id:
        return FollowDecision(FollowAction.OTHER_RUN, current)
    if current.generation is not None and advertised.generation <= current.generation:
        return FollowDecision(FollowAction.STALE, current)
    new = StoreEndpoint(advertised.host, advertised.port, advertised.generation)
    if (advertised.host, advertised.port) == (current.host, current.port):
        return FollowDecision(FollowAction.ADOPT, new)
    return FollowDecision(FollowAction.RESTART, new)
