"""A node's drain goes out once when two passes drain it at the same moment (the urgent pass
beside a full pass planned before it recorded its drain: loop.py). Seen for real in a full run
beside two CPU burners: the full pass read "recorded, not sent yet" while the urgent pass was still
publishing, and the node got the command twice."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fleetd.config import FleetdConfig
from fleetd.policy.model import Drain, Plan
from fleetd.reconcile import journal
from fleetd.reconcile.execute import ActionExecutor
from fleetd.reconcile.state import StateStore
from fleetd.shared.keyed_locks import KeyedLocks
from tests.test_reconcile_state import T0, seen


class SlowCommander:
    """A broker that takes its time to acknowledge the first drain (a loaded box)."""

    def __init__(self) -> None:
        self.drains: list[tuple[str, str | None]] = []
        self.first_publishing = asyncio.Event()
        self.release = asyncio.Event()

    async def drain(self, instance_id: str, deadline: float | None, reason: str, msg_id: str | None = None) -> None:
        self.drains.append((instance_id, msg_id))
        if len(self.drains) == 1:
            self.first_publishing.set()
            await self.release.wait()

    def node_state(self, instance_id: str) -> str | None:
        return None

    async def request_checkpoint(self, deadline: float | None, reason: str) -> None: ...

    async def stop_job(self, reason: str) -> None: ...

    async def resume_job(self, reason: str) -> None: ...


async def test_two_passes_draining_one_node_at_once_send_one_command(tmp_path: Path) -> None:
    state = await StateStore.open(tmp_path)
    try:
        await state.sync_instances([seen("i-1"), seen("i-2")], T0)
        commander = SlowCommander()
        executor = ActionExecutor(
            FleetdConfig(),
            ec2=None,  # type: ignore[arg-type]  # drains make no EC2 call
            prices=None,  # type: ignore[arg-type]
            state=state,
            commander=commander,
            dry_run=False,
            ledger_feed=None,
            clock=lambda: T0,
        )
        plan = Plan(actions=(Drain(reason="notice", instance_id="i-1", deadline=T0 + 120),))
        urgent = asyncio.create_task(executor.act_drains(plan, None, T0))  # type: ignore[arg-type]
        await commander.first_publishing.wait()
        # The full pass planned the same drain before the urgent pass recorded it; it acts now,
        # while the urgent pass's publish is still waiting for the broker.
        full = asyncio.create_task(executor.act_drains(plan, None, T0))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert len(commander.drains) == 1, "the second drain must wait for the first"
        commander.release.set()
        first, second = await urgent, await full
        assert [o.status for o in first] == ["done"]
        assert [(o.status, o.detail) for o in second] == [("done", "already sent")]
        assert commander.drains == [("i-1", commander.drains[0][1])]
        assert await journal.unsent_drains(state) == []
        # Another node's drain is not held behind this one's.
        commander.release.clear()
        other = Plan(actions=(Drain(reason="notice", instance_id="i-2", deadline=T0 + 120),))
        assert [o.status for o in await executor.act_drains(other, None, T0)] == ["done"]  # type: ignore[arg-type]
        assert [d[0] for d in commander.drains] == ["i-1", "i-2"]
    finally:
        await state.close()


async def test_a_keyed_lock_is_dropped_once_its_last_user_is_done() -> None:
    locks = KeyedLocks()
    order: list[str] = []

    async def use(name: str, key: str, hold: asyncio.Event | None = None) -> None:
        async with locks.hold(key):
            order.append(f"{name}+")
            if hold is not None:
                await hold.wait()
            order.append(f"{name}-")

    gate = asyncio.Event()
    a = asyncio.create_task(use("a", "k", gate))
    await asyncio.sleep(0)
    b = asyncio.create_task(use("b", "k"))
    c = asyncio.create_task(use("c", "other"))
    await asyncio.sleep(0.01)
    assert order == ["a+", "c+", "c-"] and locks.busy("k") and not locks.busy("other")
    gate.set()
    await asyncio.gather(a, b, c)
    assert order[3:] == ["a-", "b+", "b-"]
    assert not locks.busy("k")
