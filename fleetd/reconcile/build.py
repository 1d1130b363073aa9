"""Assemble a :class:`Reconciler` from the config: pools, launch template, prices, state.

Shared by ``fleetd run`` and the tests, so the tests exercise the production wiring.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from botocore.config import Config

from fleetd.adapters.aws_errors import PermanentAwsError
from fleetd.adapters.ec2 import AioEc2, default_zones, resolve_pools, subnets_by_zone
from fleetd.adapters.launch_template import TemplateRef, ensure_launch_template
from fleetd.adapters.pricing import DEMO_PRICE_BOOK, Ec2SpotPriceSource, FilePriceBook, Hardware, PriceSource
from fleetd.adapters.spot_advisor import load_spot_advisor
from fleetd.config import FleetdConfig
from fleetd.policy.model import PoolId
from fleetd.policy.placement import priors_for_pools
from fleetd.protocol.logs import get_logger
from fleetd.reconcile.loop import Planner, Reconciler
from fleetd.reconcile.ports import Clock, NodeCommander, NodeObserver, SignalSource, SpendSource
from fleetd.reconcile.state import StateStore

log = get_logger(__name__)

# Production: botocore's adaptive mode retries throttling with a client-side rate limiter, so the
# loop's own backoff only sees what is left after that.
PRODUCTION_RETRIES = Config(retries={"mode": "adaptive", "total_max_attempts": 6}, connect_timeout=10, read_timeout=60)


def ec2_client_kwargs(cfg: FleetdConfig) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"region_name": cfg.aws.region, "config": PRODUCTION_RETRIES}
    if cfg.aws.endpoint_url:
        kwargs["endpoint_url"] = cfg.aws.endpoint_url
    return kwargs


@dataclass
class Built:
    reconciler: Reconciler
    state: StateStore

    async def close(self) -> None:
        await self.state.close()


def price_source(cfg: FleetdConfig, client: Any) -> tuple[PriceSource, FilePriceBook]:
    """The configured file book (tests, demo, simulator), else EC2 spot history with the demo
    book's on-demand prices. Returns the book too: it also supplies hardware facts."""
    if cfg.capacity.price_book is not None:
        book = FilePriceBook.load(cfg.capacity.price_book)
        return book, book
    book = FilePriceBook.load(DEMO_PRICE_BOOK)
    return Ec2SpotPriceSource(client, on_demand=book), book


async def build_reconciler(
    cfg: FleetdConfig,
    client: Any,
    *,
    planner: Planner,
    clock: Clock = time.time,
    dry_run: bool = False,
    signals: SignalSource | None = None,
    observer: NodeObserver | None = None,
    commander: NodeCommander | None = None,
    spend: SpendSource | None = None,
    ledger: Any = None,
) -> Built:
    cap = cfg.capacity
    zones = cap.zones or await default_zones(client, cap.subnet_ids)
    try:
        resolved = await resolve_pools(client, instance_types=cap.instance_types, gpu=cap.gpu, zones=zones)
        hardware: dict[str, Hardware] = dict(resolved.hardware)
        pools = resolved.pools
    except PermanentAwsError as exc:
        # Explicit types the endpoint does not know (moto lacks p3, for one) keep the price
        # book's hardware facts; anything else (permissions, ...) is a real start-up failure.
        if not cap.instance_types or exc.code != "InvalidInstanceType":
            raise
        log.warning("instance_types_not_described", error=str(exc))
        hardware = {}
        pools = tuple(PoolId(t, z) for t in sorted(cap.instance_types) for z in zones)
    prices, book = price_source(cfg, client)
    for itype in cap.instance_types:
        described = hardware.get(itype)
        if (described is None or described.gpus == 0) and book.hardware(itype) is not None:
            hardware[itype] = book.hardware(itype)
    # A dry run never launches, so it does not create the template either.
    template = await ensure_launch_template(client, cfg) if not dry_run else TemplateRef("lt-dry-run", "$Default")
    ec2 = AioEc2(
        client,
        fleet=cfg.fleet.name,
        job=cfg.job.name,
        template=template,
        subnets_by_zone=await subnets_by_zone(client, cap.subnet_ids),
    )
    priors = priors_for_pools(load_spot_advisor(cap.spot_advisor_csv), pools) if cap.spot_advisor_csv else {}
    state = await (StateStore.open_snapshot if dry_run else StateStore.open)(cfg.fleet.state_dir)
    log.info("reconciler_ready", fleet=cfg.fleet.name, pools=[str(p) for p in pools], dry_run=dry_run,
             priors=len(priors))
    reconciler = Reconciler(
        cfg, ec2=ec2, prices=prices, state=state, pools=pools, hardware=hardware, planner=planner,
        clock=clock, signals=signals, observer=observer, commander=commander, spend=spend, priors=priors, dry_run=dry_run,
        ledger=ledger,
    )
    return Built(reconciler, state)

