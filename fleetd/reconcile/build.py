"""Assemble a :class:`Reconciler` from the config: pools, launch template, prices, state.

Shared by ``fleetd run`` and the tests, so the tests exercise the production wiring.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fleetd.adapters.aws_clients import PRODUCTION_RETRIES, ec2_client_kwargs, pricing_client_kwargs
from fleetd.adapters.aws_errors import PermanentAwsError
from fleetd.adapters.catalog import Catalog, bundled_catalog
from fleetd.adapters.ec2 import AioEc2
from fleetd.adapters.ec2_list_process import ProcessLister
from fleetd.adapters.ec2_pools import default_zones, resolve_pools, subnets_by_zone
from fleetd.adapters.ec2_view import Ec2View
from fleetd.adapters.launch_template import TemplateRef, ensure_launch_template
from fleetd.adapters.price_list import OnDemandPrices
from fleetd.adapters.pricing import FilePriceBook, Hardware, PriceSource
from fleetd.adapters.spot_advisor import load_spot_advisor
from fleetd.adapters.spot_prices import LatestSpotPrices
from fleetd.config import FleetdConfig
from fleetd.policy.model import PoolId
from fleetd.policy.placement import priors_for_pools
from fleetd.reconcile.ledger_store import LedgerStore
from fleetd.reconcile.loop import Planner, Reconciler
from fleetd.reconcile.ports import Clock, LedgerSink, NodeCommander, NodeObserver, SignalSource, SpendSource
from fleetd.reconcile.state import StateStore
from fleetd.reconcile.state_port import StateBackend
from fleetd.shared.logs import get_logger

if TYPE_CHECKING:
    from fleetd.reconcile.state_dynamo import DynamoLedger

log = get_logger(__name__)

__all__ = ["PRODUCTION_RETRIES", "ec2_client_kwargs", "pricing_client_kwargs"]  # for existing callers


@dataclass
class Built:
    reconciler: Reconciler
    state: StateBackend
    ec2_view: Ec2View | None = None  # its ``run`` is a daemon component (the EC2 refresher)
    own_ledger: LedgerStore | DynamoLedger | None = None  # opened here (no ledger was wired in)

    async def close(self) -> None:
        if self.ec2_view is not None:
            await asyncio.to_thread(self.ec2_view.close)
        if self.own_ledger is not None:
            await self.own_ledger.close()  # before the state: a dry run's copy goes with it
        await self.state.close()


async def ledger_beside(state: StateBackend) -> LedgerStore | DynamoLedger:
    """The budget ledger kept where ``state`` is, for a loop given none (a dry run: the daemon's
    wiring opens no ledger for it). Spend is always the ledger's bills: a dry run's private copy
    of the SQLite file holds the live ledger's events as of its copy, and an HA dry run reads the
    shared table's."""
    if isinstance(state, StateStore):
        return await LedgerStore.open(state.path)
    from fleetd.reconcile.state_dynamo import DynamoLedger, DynamoStateStore  # HA only

    if isinstance(state, DynamoStateStore):
        return DynamoLedger(state.table, state.fence)
    raise TypeError(f"no ledger beside a {type(state).__name__}: pass the ledger to build_reconciler")


def price_source(
    cfg: FleetdConfig, client: Any, pricing_client: Any = None, catalog: Catalog | None = None
) -> tuple[PriceSource, FilePriceBook | None]:
    """Production: current spot prices from DescribeSpotPriceHistory, refreshed every
    ``capacity.spot_price_refresh_s`` (not per pass), on-demand prices from the Price List API
    with the bundled catalog as the fallback. A file book only when configured
    explicitly (demo, simulator); it is returned too, for its hardware facts."""
    if cfg.capacity.price_book is not None:
        book = FilePriceBook.load(cfg.capacity.price_book)
        log.info("prices_from_file_book", path=str(cfg.capacity.price_book))
        return book, book
    catalog = catalog or bundled_catalog()
    use_api = cfg.capacity.on_demand_prices == "price-list" and pricing_client is not None
    if not use_api:
        log.info(
            "on_demand_prices_from_catalog",
            catalog=catalog.label,
            why="capacity.on_demand_prices = catalog" if pricing_client is not None else "no Price List client",
        )
    on_demand = OnDemandPrices(
        cfg.aws.region,
        catalog,
        client=pricing_client if use_api else None,
        refresh_s=cfg.capacity.price_refresh_s,
    )
    return LatestSpotPrices(client, on_demand=on_demand, refresh_s=cfg.capacity.spot_price_refresh_s), None


def hardware_for(
    types: Any, described: dict[str, Hardware], book: FilePriceBook | None, catalog: Catalog
) -> dict[str, Hardware]:
    """Per type: DescribeInstanceTypes' facts, else the file book's, else the catalog's; the
    relative throughput always from the catalog (DescribeInstanceTypes has none)."""
    out: dict[str, Hardware] = {}
    for itype in sorted(set(types)):
        hw = described.get(itype)
        if (hw is None or hw.gpus == 0) and book is not None and book.hardware(itype) is not None:
            hw = book.hardware(itype)
        spec = catalog.spec(itype)
        if (hw is None or hw.gpus == 0) and spec is not None and spec.whole_gpus:
            hw = Hardware(int(spec.gpus), spec.gpu_model, spec.gpu_memory_gib)
        if hw is None:
            continue
        throughput = catalog.throughput_of(itype, hw.gpu_model)
        if throughput is None:
            log.warning(
                "gpu_throughput_unknown", instance_type=itype, gpu_model=hw.gpu_model, assumed=hw.relative_throughput
            )
        else:
            hw = replace(hw, relative_throughput=throughput)
        out[itype] = hw
    return out


async def _pools_and_hardware(
    client: Any, cfg: FleetdConfig, zones: Sequence[str]
) -> tuple[tuple[PoolId, ...], dict[str, Hardware]]:
    """The pools the config names and the hardware EC2 describes for their types."""
    cap = cfg.capacity
    try:
        resolved = await resolve_pools(client, instance_types=cap.instance_types, gpu=cap.gpu, zones=zones)
        return resolved.pools, dict(resolved.hardware)
    except PermanentAwsError as exc:
        # Explicit types the endpoint does not know (moto lacks p3, for one) take the GPU
        # catalog's hardware facts (or are excluded with a reason in observe); anything else
        # (permissions, ...) is a real start-up failure.
        if not cap.instance_types or exc.code != "InvalidInstanceType":
            raise
        log.warning("instance_types_not_described", error=str(exc))
        return tuple(PoolId(t, z) for t in sorted(cap.instance_types) for z in zones), {}


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
    ledger: LedgerSink | None = None,
    pricing_client: Any = None,
    catalog: Catalog | None = None,
    state: StateBackend | None = None,
    fence: Callable[[], object] | None = None,
    listing_process: bool = False,
) -> Built:
    """``state`` and ``fence``: the HA backend and its lease (fleetd.ha.compose); without them
    the state is SQLite in ``fleet.state_dir``. ``ledger``: the budget ledger, the loop's spend
    source; without one, the ledger kept beside the state (``ledger_beside``).
    ``listing_process``: the EC2 view lists through a child process (the daemon); without, every
    listing is the adapter's own call (tests, tools)."""
    cap = cfg.capacity
    zones = cap.zones or await default_zones(client, cap.subnet_ids)
    pools, hardware = await _pools_and_hardware(client, cfg, zones)
    catalog = catalog or bundled_catalog()
    prices, book = price_source(cfg, client, pricing_client, catalog)
    hardware = hardware_for({p.instance_type for p in pools}, hardware, book, catalog)
    # A dry run never launches, so it does not create the template either.
    template = await ensure_launch_template(client, cfg) if not dry_run else TemplateRef("lt-dry-run", "$Default")
    # The pass reads EC2's instances from a view its own task refreshes (ec2_view.py): a notice
    # must not wait behind a DescribeInstances of the whole fleet.
    interval = cfg.fleet.reconcile_interval_s
    adapter = AioEc2(
        client,
        fleet=cfg.fleet.name,
        job=cfg.job.name,
        template=template,
        subnets_by_zone=await subnets_by_zone(client, cap.subnet_ids),
    )
    # The whole-fleet listing parsed in a child process (ec2_list_process.py): in a thread its
    # parse held the GIL against the intake.
    lister = ProcessLister(ec2_client_kwargs(cfg), cfg.aws.profile, cfg.fleet.name) if listing_process else None
    ec2 = Ec2View(adapter, refresh_s=interval, max_age_s=max(6 * interval, 60.0), clock=clock, lister=lister)
    priors = priors_for_pools(load_spot_advisor(cap.spot_advisor_csv), pools) if cap.spot_advisor_csv else {}
    if state is None:
        state = await (StateStore.open_snapshot if dry_run else StateStore.open)(cfg.fleet.state_dir)
    own_ledger = None
    if ledger is None:
        ledger = own_ledger = await ledger_beside(state)
    bound = None
    if cfg.team.member:
        from fleetd.team.member import TeamMember

        bound = TeamMember(cfg.fleet.name, cfg.fleet.state_dir, state, commander, dry_run=dry_run)
    log.info(
        "reconciler_ready", fleet=cfg.fleet.name, pools=[str(p) for p in pools], dry_run=dry_run, priors=len(priors)
    )
    reconciler = Reconciler(
        cfg,
        ec2=ec2,
        prices=prices,
        state=state,
        pools=pools,
        hardware=hardware,
        planner=planner,
        clock=clock,
        signals=signals,
        observer=observer,
        commander=commander,
        spend=spend,
        priors=priors,
        dry_run=dry_run,
        ledger=ledger,
        fence=fence,
        bound=bound,
    )
    return Built(reconciler, state, ec2, own_ledger)
