"""The dead man's switch: a node that has lost its control host powers itself off.

When neither the broker nor the store has answered for ``node.controller_lost_after_s``, nobody
is left to terminate this spot node, so the agent makes its newest checkpoint durable in S3 and
runs ``node.shutdown_command`` (an instance-initiated shutdown terminates a spot instance). One
reachable channel is enough to wait. (docs/DESIGN.md "Dead man's switch")
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from fleetd.shared.logs import get_logger
from fleetd.shared.waits import within

log = get_logger(__name__)


def controller_lost(last_contact: float, now: float, bound_s: float) -> bool:
    """Pure: has the controller been out of reach (no channel at all) for longer than the bound?"""
    return bound_s > 0 and now - last_contact > bound_s


@dataclass
class ControllerWatch:
    bound_s: float
    broker_up: Callable[[], bool]  # the MQTT session is connected (cheap, no I/O)
    store_up: Callable[[], bool]  # one probe of the rendezvous store (blocking: run in a thread)
    on_lost: Callable[[str], Awaitable[None]]
    interval_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    last_contact: float | None = None

    async def run(self) -> None:
        if self.bound_s <= 0:
            log.info("controller_watch_off", why="node.controller_lost_after_s = 0")
            return
        self.last_contact = self.clock()
        down_logged = False
        while True:
            await asyncio.sleep(min(self.interval_s, self.bound_s / 4))
            broker = self.broker_up()
            store = False if broker else await asyncio.to_thread(self.store_up)  # probe only if needed
            now = self.clock()
            if broker or store:
                if down_logged:
                    log.warning(
                        "controller_reachable_again",
                        broker=broker,
                        store=store,
                        after_s=round(now - self.last_contact, 1),
                    )
                self.last_contact, down_logged = now, False
                continue
            if not down_logged:
                log.warning(
                    "controller_unreachable",
                    bound_s=self.bound_s,
                    why="neither the MQTT broker nor the rendezvous store answers",
                )
                down_logged = True
            if controller_lost(self.last_contact, now, self.bound_s):
                reason = (
                    f"control host unreachable for {now - self.last_contact:.0f} s "
                    f"(> node.controller_lost_after_s = {self.bound_s:g}): broker and store both down"
                )
                log.error("controller_lost", reason=reason)
                await self.on_lost(reason)
                return


async def run_shutdown_command(argv: Sequence[str], timeout_s: float = 30.0) -> int | None:
    """Run ``node.shutdown_command`` (``systemctl poweroff`` on a real node). Returns its exit
    status (None: it could not be started, or did not finish in time)."""
    if not argv:
        log.error("shutdown_command_unset", why="node.shutdown_command is empty: the node keeps running")
        return None
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL)
    except OSError as exc:
        log.error("shutdown_command_failed", argv=list(argv), error=str(exc))
        return None
    try:
        code = await within(proc.wait(), timeout_s)
    except TimeoutError:
        log.error("shutdown_command_timeout", argv=list(argv), timeout_s=timeout_s)
        return None
    (log.warning if code == 0 else log.error)("shutdown_command_ran", argv=list(argv), exit_code=code)
    return code
