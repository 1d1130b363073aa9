"""`fleetd report [--json]`: spend, savings against on-demand and goodput from the ledger."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fleetd.commands.common import add_config_argument
from fleetd.config import DEFAULT_PATH


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p, DEFAULT_PATH)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--at",
        type=float,
        default=None,
        metavar="EPOCH_S",
        help="accrue running instances up to this time (default: now)",
    )


def run(args: argparse.Namespace) -> int:
    import asyncio
    import time

    from fleetd.config import load
    from fleetd.protocol.settings import ConfigError
    from fleetd.reconcile.ledger_store import DB_NAME, LedgerStore, LedgerStoreError

    # Without an explicit file, a host with no /etc/fleetd/fleetd.toml still reports from the
    # environment (FLEETD_FLEET__STATE_DIR) and defaults.
    path: Path | None = args.config
    if path == DEFAULT_PATH and not DEFAULT_PATH.exists():
        path = None
    try:
        cfg = load(path)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return 2
    db = cfg.fleet.state_dir / DB_NAME
    if not db.is_file():
        print(f"fleetd report: no ledger at {db} (has fleetd run with this state_dir?)", file=sys.stderr)
        return 1
    now = args.at if args.at is not None else time.time()

    async def read():
        store = await LedgerStore.open(db)
        try:
            return await store.summary(now)
        finally:
            await store.close()

    try:
        summary = asyncio.run(read())
    except LedgerStoreError as exc:
        print(f"fleetd report: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary.as_json(), indent=2, sort_keys=True))
    else:
        print(render_table(summary.as_json()))
    return 0


def render_table(data: dict) -> str:
    def usd(x: float) -> str:
        return f"${x:,.2f}"

    per_1k = data["usd_per_1k_steps"]
    rows = [
        ("spend", usd(data["spend_usd"])),
        ("on-demand equivalent", usd(data["on_demand_equivalent_usd"])),
        ("savings vs on-demand", f"{data['savings_pct']:.1f} %"),
        ("node-hours billed", f"{data['node_seconds'] / 3600:.2f}"),
        ("instances", str(data["instances"])),
        ("useful steps", f"{data['useful_steps']:,}"),
        ("steps lost", f"{data['steps_lost']:,}"),
        ("time in recovery", f"{data['recovery_s']:.1f} s"),
        ("idle GPU time", f"{data['idle_gpu_s']:.1f} GPU-s"),
        ("USD per 1,000 useful steps", "n/a (no useful steps)" if per_1k is None else usd(per_1k)),
    ]
    for market, value in data["spend_by_market"].items():
        rows.append((f"spend on {market}", usd(value)))
    for pool, value in data["spend_by_pool"].items():
        rows.append((f"spend in {pool}", usd(value)))
    width = max(len(k) for k, _ in rows)
    lines = ["fleetd cost and goodput report", ""]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)
