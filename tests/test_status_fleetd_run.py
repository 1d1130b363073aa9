"""`fleetd run` as a real process against moto: /metrics is scraped while it runs and
`fleetd status --json` counts the same nodes as EC2."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.harness.ports import free_port
from tests.reconcile_support import SPOT, TYPES, ZONES, Cloud


def config(cloud: Cloud, tmp_path: Path, metrics_port: int) -> Path:
    path = tmp_path / "fleetd.toml"
    q = lambda xs: ", ".join(f'"{x}"' for x in xs)  # noqa: E731
    path.write_text(
        f'[aws]\nendpoint_url = "{cloud.proxy.url}"\n'
        f'[fleet]\nname = "t"\nmin_nodes = 3\nmax_nodes = 3\nstate_dir = "{tmp_path / "state"}"\n'
        "reconcile_interval_s = 0.5\n"
        f"[capacity]\ninstance_types = [{q(TYPES)}]\nzones = [{q(ZONES)}]\n"
        f'ami_id = "{cloud.ami}"\nsubnet_ids = [{q(cloud.subnets[z] for z in ZONES)}]\n'
        f"[budget]\ntotal_usd = 10000.0\nmax_usd_per_hour = 100.0\n"
        f"[rendezvous]\nport = {free_port()}\n"
        f"[metrics]\nport = {metrics_port}\n[logging]\njson = true\n"
    )
    return path


def scrape(port: int) -> str:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return ""  # not listening yet


@pytest.mark.slow
async def test_fleetd_run_serves_metrics_and_status_matches_ec2(cloud: Cloud, tmp_path: Path):
    port = free_port()
    log = (tmp_path / "fleetd.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetd.cli", "run", "--config", str(config(cloud, tmp_path, port))],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        status: dict = {}
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "fleetd.log").read_text()
            r = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "fleetd.cli", "status", "--state-dir", str(tmp_path / "state"), "--json"],
                capture_output=True,
                text=True,
            )
            if r.returncode == 0:
                status = json.loads(r.stdout)
                # The first pass publishes what it observed before it launched; wait for a pass
                # that has seen the launched nodes on both surfaces.
                body = await asyncio.to_thread(scrape, port)
                if status["node_count"] == len(await cloud.instances()) == 3 and "fleetd_nodes{" in body:
                    break
            await asyncio.sleep(0.5)
        assert status.get("node_count") == len(await cloud.instances()) == 3, status
        # Prices took the production path (no price book): the Price List API's on-demand and the
        # spot history's quotes, per pool, in `fleetd status`.
        pools = {p["pool"]: p for p in status["pools"]}
        assert {str(p) for p in SPOT} == set(pools) and all(p["offered"] for p in pools.values())
        assert all(pools[str(p)]["spot_price"] == price for p, price in SPOT.items())
        assert pools["g5.xlarge@us-east-1a"]["on_demand_price"] == 1.006
        assert cloud.proxy.calls_of("GetProducts")
        body = await asyncio.to_thread(scrape, port)
        assert "fleetd_nodes{" in body and "fleetd_reconcile_passes_total" in body
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
