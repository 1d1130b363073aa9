"""Stand by until this host holds the lease, then lead until it is lost, and again.

Leading = the reconcile loop plus the components only a leader may run (steering the rendezvous,
the commander, the stall watcher), in one TaskGroup with a watch on the lease. Losing the lease
(the election says so, or a fenced write was refused: LeaseLost from anywhere in the group)
cancels all of it; the process stays up as a warm standby. Each takeover reads the shared state
again and starts a fresh loop (fleetd.reconcile.loop.Reconciler.successor).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from fleetd.adapters.aws_errors import AwsError
from fleetd.ha.election import Election
from fleetd.ha.errors import LeaseLost
from fleetd.reconcile.loop import PassReport, Reconciler
from fleetd.shared.logs import get_logger

log = get_logger(__name__)


class _Finished(Exception):
    """The loop ran its bounded number of passes (tests, `--passes`)."""


async def lead(
    ctx: Any,
    election: Election,
    refresh: Callable[[], Awaitable[None]],
    reconciler: Reconciler,
    leader_components: Sequence[Callable[[Any], Coroutine[Any, Any, None]]],
    on_pass: Callable[[PassReport], None],
    passes: int | None,
) -> None:
    current: Reconciler | None = None
    while True:
        generation = await election.wait_leading()
        try:
            await refresh()
        except LeaseLost:
            continue
        except AwsError as exc:
            # The store answered the lease write but not the read (throttled, a blip): leading
            # on a stale copy is not allowed, so wait and read again while the lease still holds.
            log.warning("takeover_read_failed", kind=exc.kind, code=exc.code, error=exc.message, retry_in_s=1.0)
            await asyncio.sleep(1.0)
            continue
        current = reconciler if current is None else current.successor()
        distrust = getattr(current.ec2, "distrust_before_now", None)
        if distrust is not None:
            distrust()  # the last leader's launches are in EC2, not in this host's listing
        ctx.reconciler = current
        log.warning(
            "leading",
            holder=election.holder,
            generation=generation,
            why="this host holds the lease: it reconciles, steers and commands",
        )

        async def reconcile(loop: Any = current) -> None:
            await loop.run(ctx.wake, passes=passes, on_pass=on_pass)
            raise _Finished

        finished = False
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(reconcile(), name="reconcile")
                for component in leader_components:
                    tg.create_task(component(ctx), name=getattr(component, "__name__", "leader-component"))
                tg.create_task(election.wait_lost(generation), name="lease-watch")
        except* LeaseLost:
            log.warning(
                "standing_by",
                holder=election.holder,
                generation=generation,
                why="lease lost: reconcile loop and leader components stopped",
            )
        except* _Finished:
            finished = True
        if finished:
            return
