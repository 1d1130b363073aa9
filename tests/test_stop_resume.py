"""A stop undone before it finished (a team's pause that ends at once): the commander drops the
stop sequence still waiting for its checkpoint, so it neither shuts the resumed nodes down nor
closes the rendezvous on them; the rendezvous is opened again and a later stop runs in full."""

from __future__ import annotations

import asyncio

from fleetd.intake.registry import NodeRegistry
from fleetd.intake.signals import TrainingSignals
from fleetd.rendezvous.commander import TrainingCommander


class Store:
    """The rendezvous as the stop sequence sees it: a checkpoint request nobody acknowledges."""

    def __init__(self) -> None:
        self.requests = 0
        self.requested = asyncio.Event()

    async def request_checkpoint(self, reason: str, hold: bool = False, by: str = "") -> int:
        self.requests += 1
        self.requested.set()
        return self.requests

    async def acks(self, seq: int) -> list:
        return []


async def test_a_resume_cancels_the_stop_under_way_and_reopens_the_rendezvous() -> None:
    store, sent, opened, closed = Store(), [], [], []

    async def send(command) -> None:
        sent.append(command)

    async def reopen() -> None:
        opened.append(1)

    async def close() -> None:
        closed.append(1)

    registry = NodeRegistry()
    commander = TrainingCommander(
        store,  # type: ignore[arg-type]  # the two calls the stop sequence makes
        send,
        registry,
        TrainingSignals(registry),
        close_rendezvous=close,
        reopen_rendezvous=reopen,
    )
    task = asyncio.create_task(commander.run(None))
    try:
        await commander.stop_job("team pause")
        await asyncio.wait_for(store.requested.wait(), 10)  # waiting for the stop's checkpoint
        await commander.resume_job("team resume")
        assert opened == [1] and closed == [] and sent == [] and not commander.stop_done.is_set()
        assert not task.done()  # the component goes on: a later stop is carried out again
        store.requested.clear()
        await commander.stop_job("team pause again")
        await asyncio.wait_for(store.requested.wait(), 10)
        assert store.requests == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()  # a cancelled component still ends cancelled (nothing swallowed)


async def test_a_stop_whose_checkpoint_never_became_durable_waits_for_the_reserve(monkeypatch) -> None:
    """Only a clean stop (checkpoint durable, agents told) lets the planner release nodes at once."""
    import fleetd.rendezvous.commander as commander_mod

    monkeypatch.setattr(commander_mod, "SAVE_TIMEOUT_S", 0.2)  # nobody acknowledges the checkpoint
    store, sent = Store(), []

    async def send(command) -> None:
        sent.append(command)

    registry = NodeRegistry()
    signals = TrainingSignals(registry)
    commander = TrainingCommander(store, send, registry, signals)  # type: ignore[arg-type]
    task = asyncio.create_task(commander.run(None))
    try:
        await commander.stop_job("budget")
        await asyncio.wait_for(commander.stop_done.wait(), 10)
        assert signals.snapshot().stop_completed_at is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
