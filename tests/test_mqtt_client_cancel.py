"""A cancellation that arrives with the broker's ack is not lost (fleetd.shared.mqtt_options.Client).

aiomqtt waits for a QoS 1 ack with ``asyncio.wait_for``; on Python 3.11 a cancel delivered in the
loop iteration the ack completes is swallowed (CPython gh-86296). The agent's event pump then
waited on an empty outbox forever and the agent never stopped after fleetd's shutdown command
(its last bound logged agent_shutdown_stuck naming the mqtt task). The race is played exactly:
the ack's waiter completes, then the pump is cancelled before the wait sees it."""

from __future__ import annotations

import asyncio
import sys

import aiomqtt
import pytest

from fleetd.shared.mqtt_options import Client


async def _pump(client: aiomqtt.Client, ack: asyncio.Event, sent: list[int]) -> None:
    """The agent's _pump_events in small: wait for the ack the way aiomqtt's publish does, then
    wait for the next event (none comes)."""
    await client._wait_for(ack.wait(), timeout=30)
    sent.append(1)
    await asyncio.Event().wait()


async def _cancel_as_the_ack_lands(client: aiomqtt.Client) -> tuple[asyncio.Task[None], bool, list[int]]:
    """Returns the pump, whether the first cancel ended it, and what it sent."""
    ack, sent = asyncio.Event(), []
    task = asyncio.create_task(_pump(client, ack, sent))
    await asyncio.sleep(0)  # the pump waits for the ack
    ack.set()
    await asyncio.sleep(0)  # the ack's waiter completes; the wait has not woken yet
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=1.0)
    if not done:  # the cancel was lost: end the pump for the test's own clean-up
        task.cancel()
        await asyncio.wait({task}, timeout=2.0)
    return task, bool(done), sent


async def test_a_cancel_that_lands_with_the_ack_ends_the_task() -> None:
    task, first_cancel_ended_it, sent = await _cancel_as_the_ack_lands(Client("127.0.0.1"))
    assert first_cancel_ended_it and task.cancelled()
    # Either outcome of the race is right (the ack seen or not); losing the cancel is not.
    assert sent in ([], [1])


async def test_a_wait_that_runs_out_is_aiomqtts_timeout_error() -> None:
    with pytest.raises(aiomqtt.MqttError, match="timed out"):
        await Client("127.0.0.1")._wait_for(asyncio.Event().wait(), timeout=0.05)


async def test_the_race_is_real_with_aiomqtts_own_wait() -> None:
    """Proof the first test plays the race: on Python 3.11 (CI's) aiomqtt's own wait loses the
    cancel; 3.12 rebuilt asyncio.wait_for on asyncio.timeout and keeps it."""
    task, first_cancel_ended_it, sent = await _cancel_as_the_ack_lands(aiomqtt.Client("127.0.0.1"))
    assert first_cancel_ended_it == (sys.version_info >= (3, 12))
    assert task.cancelled()
    if not first_cancel_ended_it:
        assert sent == [1]  # the task ran on past the ack as if never cancelled
