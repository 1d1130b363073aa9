"""Why torchrun ended, as far as the rendezvous store is concerned, and waiting for it to return.

When the rendezvous host dies or restarts (OOM kill, crash, ``systemctl restart``), every
torchrun exits within a second or two: its elastic agent reads the store each monitor interval
and gives up with ``RendezvousConnectionError``, and rank 0 fails its per-step request check
(its workers save the step they completed on the way out: agent/trainer/salvage.py). Nothing
is wrong with training, so the agent must start torchrun again as soon as the store answers;
an exit with the store alive and unchanged is a real training failure and is only reported.

Two independent facts tell them apart, so one misleading fact cannot restart a broken job in a
loop: the store itself (unreachable now, or a different incarnation than when torchrun started,
fleetd.protocol.rendezvous_keys.HOST_INCARNATION_KEY) and the reason torchrun printed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from tenacity import RetryCallState

from agent.supervise.torchrun import TorchrunExit
from agent.supervise.torchrun_main import RENDEZVOUS_FAILED_EXIT
from fleetd.shared.backoff import failure_of, retrying
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

PROBE_TIMEOUT_S = 2.0
# What torchrun's elastic agent prints when the store went away under it (torch 2.x).
# (Not gloo's "Connection reset by peer": a lost peer prints that, and torchrun restarts its
# workers itself for that.)
STORE_GONE_MARKERS = (
    "RendezvousConnectionError",
    "The connection to the C10d store has failed",
    # Another node's torchrun exited by an exception and closed torch's rendezvous; fleetd's
    # steering reopens it (only fleetd ends a job): start again once the store answers.
    "RendezvousClosedError",
)


@dataclass(frozen=True, slots=True)
class StoreProbe:
    reachable: bool
    incarnation: str | None = None
    error: str = ""


class ExitCause(StrEnum):
    FINISHED = "finished"  # the job completed: nothing to restart
    STOPPED = "stopped"  # this agent stopped it (drain, leave, shutdown)
    STORE_LOST = "store-lost"  # the rendezvous store died or restarted: restart once it answers
    # torchrun's own rendezvous failed with the store fine (torchrun_main.RENDEZVOUS_FAILED_EXIT):
    # the round, not the job's code; restart as for a lost store
    RENDEZVOUS_FAILED = "rendezvous-failed"
    FAILED = "failed"  # training itself failed with the store fine: report, fleetd decides


def probe(host: str, port: int, run_id: str, timeout_s: float = PROBE_TIMEOUT_S) -> StoreProbe:
    """One connection and one read (blocking: call through asyncio.to_thread)."""
    from agent.trainer.store_link import StoreLink, StoreLinkError

    try:
        link = StoreLink(host, port, run_id, timeout_s=timeout_s).connect()
        return StoreProbe(True, link.incarnation())
    except StoreLinkError as exc:
        return StoreProbe(False, error=str(exc)[:200])


def log_size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def log_tail(path: Path | None, since: int = 0, nbytes: int = 16_384) -> str:
    """The end of torchrun's log, written after offset ``since`` (this run of torchrun only)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            if f.tell() < since:
                since = 0  # rotated since this run began (agent/supervise/worker_output.py)
            f.seek(max(since, f.tell() - nbytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def classify_exit(exit_: TorchrunExit, before: StoreProbe, after: StoreProbe, tail: str) -> ExitCause:
    """Pure: the exit, the store as seen before torchrun started and right after it ended, and
    the end of torchrun's log."""
    if exit_.reason == "stopped":
        return ExitCause.STOPPED
    if exit_.reason == "finished":
        return ExitCause.FINISHED
    if not after.reachable:
        return ExitCause.STORE_LOST
    restarted = (
        before.incarnation is not None and after.incarnation is not None and before.incarnation != after.incarnation
    )
    if restarted:
        return ExitCause.STORE_LOST
    # Reachable and the same life as before (or unknown): torchrun's own words can still say the
    # store went away (a network cut to the control host that healed, or a store whose first
    # incarnation was never read).
    if any(m in tail for m in STORE_GONE_MARKERS):
        return ExitCause.STORE_LOST
    if exit_.exit_code == RENDEZVOUS_FAILED_EXIT and not exit_.job_failed:
        return ExitCause.RENDEZVOUS_FAILED
    return ExitCause.FAILED


class _NoAnswer(Exception):
    def __init__(self, probe: StoreProbe) -> None:
        super().__init__(probe.error)
        self.probe = probe


async def wait_for_store(check: Callable[[], StoreProbe], stop: asyncio.Event) -> StoreProbe | None:
    """Probe until the store answers (returns that probe) or ``stop`` is set (returns None)."""
    reported = False

    def unreachable(state: RetryCallState) -> None:
        nonlocal reported
        if not reported:
            log.warning("rendezvous_store_unreachable", error=str(failure_of(state)))
            reported = True

    try:
        async for attempt in retrying(0.25, 5.0, retry_on=_NoAnswer, stop=stop, before_sleep=unreachable):
            if stop.is_set():
                return None
            with attempt:
                found = await asyncio.to_thread(check)
                if not found.reachable:
                    raise _NoAnswer(found)
    except _NoAnswer:
        return None  # stopped
    if reported:
        log.warning("rendezvous_store_back", incarnation=found.incarnation)
    return found
