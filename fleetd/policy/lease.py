"""Leader election by lease: the pure decisions (plain data in, ``now`` passed in, no I/O).

One lease record per fleet in the shared store (fleetd/ha/election.py writes it with conditional
puts): ``holder``, ``generation`` (the fence every leader write is conditioned on) and ``version``
(fresh on every write, renewals included). No clocks are compared: a standby takes over once the
record stayed unchanged for ``lease_s`` on its own monotonic clock (docs/DESIGN.md "High availability").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    holder: str
    generation: int
    version: str


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    lease_s: float
    renew_every_s: float
    guard_s: float  # the holder stops this long before its lease could expire for anyone else
    poll_s: float = 1.0  # a standby reads the record this often: a takeover comes at most ~2 polls late

    @classmethod
    def for_lease(cls, lease_s: float) -> LeaseTiming:
        # Renew three times per lease: two renewals may fail (a network blip) before it is lost.
        # A standby starts its watch at its first read after the last renewal and acts at its first
        # read after lease_s of silence, so it polls often (a GetItem; cheap) to keep the takeover
        # near lease_s after the leader's last renewal.
        return cls(lease_s, lease_s / 3.0, lease_s / 4.0, lease_s / 8.0)


@dataclass(frozen=True, slots=True)
class LeaseState:
    """What one host knows, by its own clock."""

    seen: LeaseRecord | None = None  # the record as last read
    seen_since: float | None = None  # when this host first read exactly ``seen``
    held: int | None = None  # the generation this host holds, if it leads
    valid_until: float | None = None  # it leads until then unless a renewal succeeds

    def leads(self, now: float) -> bool:
        return self.held is not None and self.valid_until is not None and now < self.valid_until


class Step(StrEnum):
    ACQUIRE = "acquire"  # write ``write`` if the store still holds ``expect``
    RENEW = "renew"
    WAIT = "wait"  # another host leads (or may still)


@dataclass(frozen=True, slots=True)
class Decision:
    step: Step
    reason: str
    expect: LeaseRecord | None = None  # the conditional write's precondition (None: no record yet)
    write: LeaseRecord | None = None


def observe(me: str, state: LeaseState, record: LeaseRecord | None, now: float) -> tuple[LeaseState, str | None]:
    """Fold one read of the record in. Returns the new state and, when this host led and no
    longer does, why (the caller logs it and stops acting)."""
    seen_since = state.seen_since if record == state.seen and state.seen_since is not None else now
    state = replace(state, seen=record, seen_since=seen_since)
    if state.held is None:
        return state, None
    if record is None or record.holder != me or record.generation != state.held:
        return replace(state, held=None, valid_until=None), "another host took the lease"
    if not state.leads(now):
        return replace(state, held=None, valid_until=None), "lease expired before a renewal succeeded"
    return state, None


def decide(me: str, state: LeaseState, now: float, timing: LeaseTiming, new_version: str) -> Decision:
    """The next lease write, if any. ``new_version`` is a fresh unique value (the caller's uuid)."""
    rec = state.seen
    if state.leads(now) and rec is not None:
        return Decision(Step.RENEW, "renew", expect=rec, write=LeaseRecord(me, rec.generation, new_version))
    if rec is None:
        return Decision(Step.ACQUIRE, "no lease record yet", expect=None, write=LeaseRecord(me, 1, new_version))
    if not rec.holder:
        return Decision(
            Step.ACQUIRE,
            "the last leader released the lease",
            expect=rec,
            write=LeaseRecord(me, rec.generation + 1, new_version),
        )
    unchanged_for = now - (state.seen_since if state.seen_since is not None else now)
    if unchanged_for >= timing.lease_s:
        return Decision(
            Step.ACQUIRE,
            f"{rec.holder} has not renewed for {unchanged_for:.1f} s",
            expect=rec,
            write=LeaseRecord(me, rec.generation + 1, new_version),
        )
    return Decision(Step.WAIT, f"{rec.holder} leads (generation {rec.generation})")


def after_write(
    state: LeaseState, decision: Decision, ok: bool, started_at: float, timing: LeaseTiming
) -> tuple[LeaseState, str | None]:
    """Fold the conditional write's result in; ``started_at``: when the write was sent (the
    lease is counted from then, never from the reply). Returns (state, why it lost the lease)."""
    assert decision.write is not None
    if ok:
        return LeaseState(
            seen=decision.write,
            seen_since=started_at,
            held=decision.write.generation,
            # From the send, not the answer: a standby's watch starts after the write completed, so the
            # holder always stops acting before any standby can have started.
            valid_until=started_at + timing.lease_s - timing.guard_s,
        ), None
    # Refused: somebody else wrote first. Forget the record so the next read restarts the watch.
    lost = "a renewal was refused: another host took the lease" if state.held is not None else None
    return LeaseState(), lost
