"""Reconcile pass latency at fleet scale: N fleet instances (in-memory EC2, real planner, real
SQLite state, the demo price book), each pass observe -> plan -> act -> record.

    .venv/bin/python bench/reconcile_pass.py [--nodes 2000] [--passes 50]

Prints p50/p99/max pass time; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from fleetd.adapters.ec2 import LaunchSpec
from fleetd.adapters.ec2_fake import FakeEc2
from fleetd.adapters.pricing import FilePriceBook
from fleetd.config import BudgetConfig, CapacityConfig, FleetConfig, FleetdConfig
from fleetd.gc_pacing import GcPacing
from fleetd.policy.model import Market
from fleetd.policy.planner import plan
from fleetd.reconcile.build import ledger_beside
from fleetd.reconcile.loop import Reconciler
from fleetd.reconcile.state import StateStore


async def main(nodes: int, passes: int, gc_pacing: bool = True) -> dict:
    book = FilePriceBook.demo()
    pools = tuple(p for p in book.pools if p.instance_type in ("g4dn.xlarge", "g5.xlarge", "g6.xlarge"))
    clock_t = [time.time()]
    ec2 = FakeEc2(lambda: clock_t[0])
    for n, pool in enumerate(pools):  # the fleet already exists, spread over the pools
        share = nodes // len(pools) + (1 if n < nodes % len(pools) else 0)
        await ec2.launch(LaunchSpec(f"seed-{n}", share, Market.SPOT, (pool,)))
    cfg = FleetdConfig(
        fleet=FleetConfig(name="bench", min_nodes=nodes, max_nodes=nodes, state_dir=Path(tempfile.mkdtemp())),
        capacity=CapacityConfig(
            instance_types=tuple(sorted({p.instance_type for p in pools})), zones=("us-east-1a", "us-east-1b")
        ),
        budget=BudgetConfig(total_usd=1e9, max_usd_per_hour=1e6),
    )
    state = await StateStore.open(cfg.fleet.state_dir)
    r = Reconciler(
        cfg,
        ec2=ec2,
        prices=book,
        state=state,
        pools=pools,
        hardware={p.instance_type: book.hardware(p.instance_type) for p in pools},
        planner=plan,
        clock=lambda: clock_t[0],
        ledger=await ledger_beside(state),
    )
    times = []
    pacing = GcPacing(clock=lambda: clock_t[0])  # as the daemon: full collections between passes
    if gc_pacing:
        pacing.install()
    try:
        for _ in range(passes):
            t0 = time.perf_counter()
            report = await r.run_pass()
            times.append(time.perf_counter() - t0)
            assert report.error is None
            clock_t[0] += cfg.fleet.reconcile_interval_s
            pacing.after_pass()
    finally:
        pacing.uninstall()
    await state.close()
    first = times[0]
    times.sort()
    out = {
        "nodes": nodes,
        "passes": passes,
        "gc_pacing": gc_pacing,
        "full_collections_between_passes": pacing.collections,
        "first_pass_s": round(first, 4),
        "p50_s": round(statistics.median(times), 4),
        "p99_s": round(times[min(len(times) - 1, int(0.99 * len(times)))], 4),
        "live_after": len(ec2.live()),
    }
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--passes", type=int, default=50)
    ap.add_argument(
        "--no-gc-pacing",
        action="store_true",
        help="leave full garbage collections to CPython (they then run inside passes)",
    )
    a = ap.parse_args()
    result = asyncio.run(main(a.nodes, a.passes, gc_pacing=not a.no_gc_pacing))
    print(
        f"reconcile pass with {result['nodes']} nodes: p50 {result['p50_s'] * 1000:.0f} ms, "
        f"p99 {result['p99_s'] * 1000:.0f} ms (first pass, adopting all: {result['first_pass_s'] * 1000:.0f} ms)"
    )
    print(json.dumps(result))
