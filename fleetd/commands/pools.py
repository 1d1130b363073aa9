"""`fleetd pools --region R [--config F] [--json] [--live]`: the pools a config would bid on in a
region (every GPU instance type sold there without a config), with GPUs, GPU model, memory,
on-demand price, spot price when known, relative training throughput, and why any is excluded.

Offline by default, from the bundled GPU catalog (no AWS needed). ``--live`` asks the Price List
API and DescribeSpotPriceHistory (and DescribeAvailabilityZones when the config names no zones),
with the config's credentials and endpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetd.policy.model import PoolId


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--region", metavar="R", help="AWS region (default: aws.region of --config)")
    p.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help="list this config's pools (capacity.instance_types or capacity.gpu x zones); "
        "without it: every GPU instance type sold in the region",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--live",
        action="store_true",
        help="ask AWS (Price List API, spot price history) instead of the bundled catalog alone",
    )


def run(args: argparse.Namespace) -> int:
    from fleetd.adapters.catalog import CatalogError, bundled_catalog
    from fleetd.pool_listing import list_pools
    from fleetd.shared.settings import ConfigError

    cfg = None
    if args.config is not None:
        from fleetd.config import load

        try:
            cfg = load(args.config)
        except ConfigError as exc:
            print(exc.render(), file=sys.stderr)
            return 2
    region = args.region or (cfg.aws.region if cfg is not None else None)
    if not region:
        print("fleetd pools: give --region (or --config with aws.region)", file=sys.stderr)
        return 2
    try:
        catalog = bundled_catalog()
    except CatalogError as exc:
        print(f"fleetd pools: {exc}", file=sys.stderr)
        return 1
    cap = cfg.capacity if cfg is not None else None
    zones = [z for z in (cap.zones if cap else ()) if z.startswith(region)]
    on_demand: dict[str, tuple[float, str]] | None = None
    spot: dict[PoolId, float] | None = None
    source = catalog.label
    if args.live:
        from fleetd.adapters.aws_errors import AwsError
        from fleetd.shared.logs import configure_logging

        # Logs (which source priced what) on stderr: stdout is the listing.
        configure_logging(cfg.logging.level if cfg is not None else "info", stream=sys.stderr)
        from fleetd.commands.run import run_bounded
        from fleetd.config import FleetdConfig
        from fleetd.pool_listing import types_for
        from fleetd.pool_prices import live_prices

        live_cfg = cfg or FleetdConfig()
        types = types_for(catalog, region, cap.instance_types if cap else (), cap.gpu if cap else None)
        try:
            on_demand, spot, zones = run_bounded(live_prices(live_cfg, catalog, region, types, zones))
        except AwsError as exc:
            print(f"fleetd pools --live: {exc}", file=sys.stderr)
            return 1
        source = "live: Price List API (catalog for what it does not price), DescribeSpotPriceHistory"
    rows = list_pools(
        catalog,
        region,
        instance_types=cap.instance_types if cap else (),
        gpu=cap.gpu if cap else None,
        zones=zones,
        on_demand=on_demand,
        spot=spot,
        configured=cfg is not None,
    )
    report = {
        "region": region,
        "config": str(args.config) if args.config else None,
        "source": source,
        "catalog": {"prices_as_of": catalog.prices_as_of, "generated_at": catalog.generated_at},
        "relative_throughput_note": "training throughput of one GPU relative to one A10G; approximate "
        "(see gpu_models.*.basis in fleetd/data/gpu_catalog.json)",
        "pools": [r.as_dict() for r in rows],
        "offered": sum(1 for r in rows if r.excluded is None),
        "unverified_prices": sum(1 for r in rows if r.on_demand_usd_per_hour is not None and not r.on_demand_verified),
        "excluded": sum(1 for r in rows if r.excluded is not None),
    }
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def render(report: dict[str, Any]) -> str:
    lines = [
        f"{report['region']}: {report['offered']} pool(s) offered, {report['excluded']} excluded;"
        f" prices: {report['source']}"
    ]
    cols = ("POOL", "GPUS", "MODEL", "GPU GiB", "$/H OD", "$/GPU-H OD", "$/H SPOT", "REL TPUT")
    rows = [cols]
    for p in report["pools"]:
        if p["excluded"] is None:
            rows.append(
                (
                    p["pool"],
                    _fmt(p["gpus"], "g"),
                    _fmt(p["gpu_model"]),
                    _fmt(p["gpu_memory_gib"], "g"),
                    _fmt(p["on_demand_usd_per_hour"], ".4f") + ("" if p["on_demand_verified"] else "?"),
                    _fmt(p["on_demand_usd_per_gpu_hour"], ".4f") + ("" if p["on_demand_verified"] else "?"),
                    _fmt(p["spot_usd_per_hour"], ".4f"),
                    _fmt(p["relative_throughput"], "g"),
                )
            )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(cols))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    excluded = [p for p in report["pools"] if p["excluded"] is not None]
    if excluded:
        lines.append("excluded:")
        lines += [f"  {p['pool']}: {p['excluded']}" for p in excluded]
    if any(p["on_demand_usd_per_hour"] is not None and not p["on_demand_verified"] for p in report["pools"]):
        lines.append(
            "?: the bundled catalog's price with no licensed source behind it (fleetd/data/README.md);"
            " the daemon treats it as unknown until the Price List API answers"
        )
    lines.append(f"relative throughput: {report['relative_throughput_note']}")
    return "\n".join(lines)
