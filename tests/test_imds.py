"""The IMDSv2 client and spot watcher against the fake IMDS (real HTTP on a random port)."""

from __future__ import annotations

import asyncio
import time

import pytest
from structlog.testing import capture_logs

from agent.doubles.fake_imds import FakeImds
from agent.node.imds import (
    IDENTITY_PATHS,
    INSTANCE_ACTION_PATH,
    REBALANCE_PATH,
    ImdsClient,
    ImdsError,
    SpotSignal,
    SpotWatcher,
    read_identity,
)


@pytest.fixture
async def fake():
    async with FakeImds(instance_id="i-0aaaabbbbccccdddd", instance_type="p4d.24xlarge", zone="us-east-1c") as f:
        yield f


async def test_identity_is_read_with_a_token(fake: FakeImds) -> None:
    async with ImdsClient(fake.url) as client:
        ident = await client.identity()
    assert ident.instance_id == "i-0aaaabbbbccccdddd"
    assert ident.instance_type == "p4d.24xlarge"
    assert ident.zone == "us-east-1c"
    assert ident.lifecycle == "spot"
    assert ident.local_ipv4 == "127.0.0.1"
    assert fake.token_requests == 1
    assert fake.rejected_401 == 0


async def test_no_signal_is_none_then_scheduled_signals_appear(fake: FakeImds) -> None:
    async with ImdsClient(fake.url) as client:
        assert await client.instance_action() is None
        assert await client.rebalance() is None
        fake.schedule_notice(in_s=0, action="stop", action_in_s=120)
        fake.schedule_rebalance(in_s=0)
        action = await client.instance_action()
        rebalance = await client.rebalance()
    assert action is not None and action.action == "stop"
    assert 110 < action.time.timestamp() - time.time() <= 121
    assert rebalance is not None and abs(rebalance.notice_time.timestamp() - time.time()) < 5


async def test_token_is_refreshed_before_expiry(fake: FakeImds) -> None:
    # TTL 2 s: the client refreshes half a second before expiry, so no GET ever sees a 401.
    async with ImdsClient(fake.url, token_ttl_s=2) as client:
        for _ in range(10):
            assert await client.instance_action() is None
            await asyncio.sleep(0.25)
    assert fake.token_requests >= 2
    assert fake.rejected_401 == 0


async def test_forced_token_expiry_and_401_are_recovered_transparently(fake: FakeImds) -> None:
    async with ImdsClient(fake.url) as client:
        await client.instance_action()
        fake.expire_tokens()
        assert await client.instance_action() is None  # 401 -> new token -> retried
        fake.inject("401", count=1)
        assert await client.rebalance() is None
    assert fake.rejected_401 == 1
    assert fake.token_requests == 3


@pytest.mark.parametrize("fault", ["500", "timeout", "garbage"])
async def test_faults_raise_imds_error_then_recover(fake: FakeImds, fault: str) -> None:
    fake.timeout_fault_s = 1.0
    fake.schedule_notice(in_s=0)
    async with ImdsClient(fake.url, timeout_s=0.3) as client:
        await client.instance_action()  # token first, so the fault hits the metadata GET
        fake.inject(fault, count=1, path_prefix=INSTANCE_ACTION_PATH)
        with pytest.raises(ImdsError):
            await client.instance_action()
        action = await client.instance_action()
    assert action is not None and action.action == "terminate"


async def test_watcher_survives_every_fault_and_reports_each_signal_once(fake: FakeImds) -> None:
    """Timeouts, 401s, 5xx, garbage and a forced token expiry in one run: the watcher keeps
    polling, logs failures, and reports the notice and the rebalance exactly once each."""
    fake.timeout_fault_s = 0.5
    seen: list[SpotSignal] = []

    async def on_signal(sig: SpotSignal) -> None:
        seen.append(sig)

    async with ImdsClient(fake.url, timeout_s=0.25) as client:
        ident = await read_identity(client)
        watcher = SpotWatcher(client, on_signal, interval_s=0.05)
        with capture_logs() as logs:
            task = asyncio.create_task(watcher.run())
            for kind in ("500", "garbage", "timeout", "401"):
                fake.inject(kind, count=2, path_prefix="/latest/meta-data/spot/")
                await asyncio.sleep(0.3)
            fake.expire_tokens()
            fake.schedule_rebalance(in_s=0)
            fake.inject("garbage", count=1, path_prefix=REBALANCE_PATH)
            await asyncio.sleep(0.4)
            fake.schedule_notice(in_s=0)
            deadline = time.monotonic() + 5
            while sum(1 for s in seen if s.action) < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # more polls: the same notice must not be reported again
            assert not task.done(), "the watcher died"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    assert ident.instance_id == fake.instance_id
    assert [s for s in seen if s.action is not None].__len__() == 1
    assert [s for s in seen if s.rebalance is not None].__len__() == 1
    failures = [e for e in logs if e["event"] == "imds_poll_failed"]
    reasons = " ".join(e["error"] for e in failures)
    assert "HTTP 500" in reasons and "malformed" in reasons and "Timeout" in reasons
    # identity once, at start; signal paths polled many times
    for path in IDENTITY_PATHS.values():
        assert fake.requests[path] == 1, path
    assert fake.requests[INSTANCE_ACTION_PATH] > 10


async def test_read_identity_retries_until_imds_answers(fake: FakeImds) -> None:
    fake.inject("500", count=2, path_prefix=IDENTITY_PATHS["instance_id"])
    async with ImdsClient(fake.url) as client:
        ident = await asyncio.wait_for(read_identity(client, retry_s=0.05), 5)
    assert ident.instance_id == fake.instance_id
    assert fake.requests[IDENTITY_PATHS["instance_id"]] == 3


async def test_unreachable_imds_is_an_error_not_a_crash() -> None:
    async with ImdsClient("http://127.0.0.1:9", timeout_s=0.5) as client:
        with pytest.raises(ImdsError):
            await client.instance_action()
