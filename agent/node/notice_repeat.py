"""Re-publish a standing interruption notice until the agent stops.

The controller may lose a notice it was told about: ``fleetd run`` SIGKILLed after the broker got
its acknowledgement but before its state DB recorded the notice, or a broker restarted without
persistence (its queued messages are gone). The notice still stands in IMDS, so the agent says it
again every ``every_s``, each time as a new message: a controller that knew already ignores it
(its registry keeps the first notice time, its state DB counts one notice per instance), and one
that did not learns it within one period and drains the node before AWS acts.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from fleetd.protocol.messages import Notice
from fleetd.shared.waits import wait_set

REPEAT_S = 10.0


async def repeat_notice(
    publish: Callable[[Notice], Awaitable[None]], notice: Notice, stop: asyncio.Event, every_s: float = REPEAT_S
) -> None:
    while not stop.is_set():
        if await wait_set(stop, every_s):
            return
        await publish(notice.model_copy(update={"msg_id": uuid.uuid4().hex, "sent_at": datetime.now(UTC)}))
