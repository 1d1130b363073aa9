"""fleetd running against moto: /metrics is scraped while it runs, and `fleetd status --json` (a
separate process reading the state directory) counts the same nodes as EC2."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from fleetd.daemon import DaemonContext, Plugins, run_daemon
from fleetd.policy.planner import plan
from fleetd.protocol import rendezvous_keys as keys
from fleetd.publish import status_component
from fleetd.rendezvous import state as codec
from fleetd.rendezvous.host import open_server
from fleetd.shared.settings import AwsConfig, RendezvousConfig
from tests.harness.ports import free_port
from tests.reconcile_support import Cloud

FLEETD = str(Path(sys.executable).parent / "fleetd")


def scrape_samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def fleetd_status(state_dir: Path) -> dict:
    result = await asyncio.to_thread(
        subprocess.run,
        [FLEETD, "status", "--state-dir", str(state_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


async def test_metrics_and_status_agree_with_ec2_while_fleetd_runs(cloud: Cloud, tmp_path: Path):
    # The rendezvous host (its own process in production) with a round torchrun would have formed.
    rdzv = RendezvousConfig(host="127.0.0.1", port=free_port(), run_id="e2e")
    store = await asyncio.to_thread(open_server, rdzv.host, rdzv.port)
    formed = codec.RendezvousState(
        round=2, complete=True, participants={codec.NodeId(f"10.0.0.{i}", 7, 0): i for i in range(3)}
    )
    await asyncio.to_thread(store.set, keys.torch_state_key(rdzv.run_id), codec.encode(formed))
    cfg = cloud.config(tmp_path / "state", nodes=3)
    cfg = cfg.model_copy(
        update={
            "aws": AwsConfig(region="us-east-1", endpoint_url=cloud.proxy.url),
            "rendezvous": rdzv,
        }
    )
    ports: list[int] = []
    ctx = DaemonContext(cfg)
    daemon = asyncio.create_task(
        run_daemon(
            cfg,
            planner=plan,
            ctx=ctx,
            session=cloud.session,
            plugins=Plugins(components=[status_component(port=0, on_listening=ports.append)]),
        )
    )
    try:
        deadline = time.monotonic() + 120  # generous: a loaded 2-core CI box
        status: dict = {}
        ec2: list = []
        while time.monotonic() < deadline:
            assert not daemon.done(), daemon.exception() if daemon.done() else None
            if (tmp_path / "state" / "status.json").exists():
                status = await fleetd_status(tmp_path / "state")
                ec2 = await cloud.instances()
                if status["node_count"] == len(ec2) == 3 and status["rendezvous"] is not None:
                    break
            await asyncio.sleep(0.3)
        assert status.get("node_count") == len(ec2) == 3 and status.get("rendezvous"), (status, len(ec2))
        assert sorted(n["instance_id"] for n in status["nodes"]) == sorted(i["InstanceId"] for i in ec2)
        assert status["source"] == "snapshot" and status["stale"] is False
        assert status["budget"]["total_usd"] == 10_000.0 and status["target_nodes"] == 3
        assert status["rendezvous"] == {"round": 2, "world_size": 3}

        assert ports, "the metrics server never reported its port"
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{ports[0]}/metrics") as resp:
                assert resp.status == 200
                samples = scrape_samples(await resp.text())
    finally:
        ctx.stopping.set()
        assert await asyncio.wait_for(daemon, 30) == 0
        del store
    nodes = {k: v for k, v in samples.items() if k[0] == "fleetd_nodes"}
    assert sum(nodes.values()) == 3
    assert all(dict(k[1])["market"] in ("spot", "on-demand") and "@" in dict(k[1])["pool"] for k in nodes)
    assert samples[("fleetd_budget_total_usd", ())] == 10_000.0
    assert samples[("fleetd_budget_left_usd", ())] <= 10_000.0
    assert samples[("fleetd_target_nodes", ())] == 3
    assert samples[("fleetd_info", (("fleet", "t"),))] == 1
    assert samples[("fleetd_rendezvous_round", ())] == 2 and samples[("fleetd_rendezvous_world_size", ())] == 3
    # The reconcile loop's own counters are served too (default registry).
    assert any(k[0] == "fleetd_actions_total" and dict(k[1]).get("action") == "Launch" for k in samples)
