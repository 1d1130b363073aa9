"""The fake IMDS follows the IMDSv2 token rules, and runs standalone with a control API (demo)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp

from agent.doubles.fake_imds import FakeImds, control
from agent.node.imds import INSTANCE_ACTION_PATH, TOKEN_HEADER, TOKEN_PATH, TTL_HEADER, ImdsClient
from tests.harness.ports import free_port, wait_port


async def test_token_rules() -> None:
    async with FakeImds() as fake, aiohttp.ClientSession() as http:
        async with http.put(fake.url + TOKEN_PATH) as r:
            assert r.status == 400  # no TTL header
        async with http.put(fake.url + TOKEN_PATH, headers={TTL_HEADER: "21601"}) as r:
            assert r.status == 400  # TTL out of range
        async with http.get(fake.url + "/latest/meta-data/instance-id") as r:
            assert r.status == 401  # IMDSv1 style: refused
        async with http.get(fake.url + "/latest/meta-data/instance-id", headers={TOKEN_HEADER: "forged"}) as r:
            assert r.status == 401
        async with http.put(fake.url + TOKEN_PATH, headers={TTL_HEADER: "1"}) as r:
            assert r.status == 200
            token = await r.text()
        async with http.get(fake.url + "/latest/meta-data/instance-id", headers={TOKEN_HEADER: token}) as r:
            assert r.status == 200 and await r.text() == fake.instance_id
        await asyncio.sleep(1.1)
        async with http.get(fake.url + "/latest/meta-data/instance-id", headers={TOKEN_HEADER: token}) as r:
            assert r.status == 401  # expired
        async with http.put(fake.url + TOKEN_PATH, headers={TTL_HEADER: "60"}) as r:
            token = await r.text()
        async with http.get(fake.url + INSTANCE_ACTION_PATH, headers={TOKEN_HEADER: token}) as r:
            assert r.status == 404


async def test_scheduled_in_the_future_is_not_visible_yet() -> None:
    async with FakeImds() as fake, ImdsClient(fake.url) as client:
        fake.schedule_notice(in_s=0.6)
        assert await client.instance_action() is None
        await asyncio.sleep(0.7)
        assert (await client.instance_action()) is not None


async def test_standalone_process_with_control_api() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent.doubles.fake_imds",
            "--port",
            str(port),
            "--instance-id",
            "i-0fedcba987654321f",
            "--lifecycle",
            "on-demand",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        await asyncio.to_thread(wait_port, "127.0.0.1", port, 15)
        url = f"http://127.0.0.1:{port}"
        async with ImdsClient(url) as client:
            ident = await client.identity()
            assert (ident.instance_id, ident.lifecycle) == ("i-0fedcba987654321f", "on-demand")
            assert await client.instance_action() is None
            await asyncio.to_thread(control, url, "notice", in_s=0, action="hibernate")
            action = await client.instance_action()
            assert action is not None and action.action == "hibernate"
            await asyncio.to_thread(control, url, "rebalance")
            assert await client.rebalance() is not None
            await asyncio.to_thread(control, url, "clear")
            assert await client.instance_action() is None
        stats = await asyncio.to_thread(
            lambda: json.loads(__import__("urllib.request").request.urlopen(url + "/_fake/stats", timeout=5).read())
        )
        assert stats["requests"][INSTANCE_ACTION_PATH] == 3
    finally:
        proc.terminate()
        out, _ = await asyncio.to_thread(proc.communicate, timeout=10)
    assert proc.returncode == 0
    assert json.loads(out.splitlines()[0])["instance_id"] == "i-0fedcba987654321f"
