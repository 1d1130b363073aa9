"""Where prices come from: EC2's spot price history, or a file price book.

Both implement :class:`PriceSource`. Production's reconcile loop reads EC2's current spot prices
through fleetd/adapters/spot_prices.py (on their own refresh interval, with on-demand prices from
the Price List API or the bundled GPU catalog, fleetd/adapters/price_list.py); the history source
here serves ``fleetd pools``. The file book serves the local demo and the simulator, and only when
configured explicitly (``capacity.price_book``).
Prices are USD per instance-hour; ``trend`` is the change of the spot price in USD/h per hour over
the recent window (positive: getting dearer).
"""

from __future__ import annotations

import bisect
import csv
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from fleetd.adapters.aws_errors import aws_call
from fleetd.policy.model import PoolId
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

DEMO_PRICE_BOOK = Path(__file__).resolve().parent.parent / "data" / "demo_prices.json"


@dataclass(frozen=True, slots=True)
class PoolPrice:
    pool: PoolId
    spot: float | None  # None: no spot price known for this pool
    on_demand: float | None
    trend: float = 0.0


@dataclass(frozen=True, slots=True)
class Hardware:
    """What one instance of a type carries (from DescribeInstanceTypes or the price book)."""

    gpus: int
    gpu_model: str = ""
    gpu_memory_gib: float = 0.0  # per GPU
    relative_throughput: float = 1.0  # one GPU's training throughput vs one A10G (GPU catalog)


class PriceSource(Protocol):
    async def prices(self, pools: Sequence[PoolId], now: float) -> dict[PoolId, PoolPrice]:
        """Current prices for ``pools`` at ``now`` (seconds on the caller's clock). Pools the
        source knows nothing about are left out."""
        ...


class PriceBookError(ValueError):
    """The price book file is malformed; the message names the file and the entry."""


def slope_per_hour(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, price) points, in USD/h per hour; 0 for < 2 points."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mp = sum(p for _, p in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    cov = sum((t - mt) * (p - mp) for t, p in points)
    return cov / var * 3600.0


@dataclass
class _Series:
    """A step function of time: the price in force from each point's time on."""

    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, t: float, value: float) -> None:
        i = bisect.bisect_right(self.times, t)
        self.times.insert(i, t)
        self.values.insert(i, value)

    def at(self, now: float) -> float | None:
        if not self.times:
            return None
        i = bisect.bisect_right(self.times, now) - 1
        # Before the first point the first price applies: a book describes "from now on".
        return self.values[max(i, 0)]

    def window(self, now: float, window_s: float) -> list[tuple[float, float]]:
        lo = bisect.bisect_left(self.times, now - window_s)
        hi = bisect.bisect_right(self.times, now)
        return list(zip(self.times[lo:hi], self.values[lo:hi], strict=True))


class FilePriceBook:
    """Spot and on-demand prices per pool from JSON or CSV, optionally over time.

    JSON::

        {"schema_version": 1,
         "pools": [{"instance_type": "g5.xlarge", "zone": "us-east-1a",
                    "on_demand": 1.006, "spot": 0.41,            # or [[t, price], ...]
                    "gpus": 1, "gpu_model": "A10G", "gpu_memory_gib": 24}]}

    CSV: header ``instance_type,zone,on_demand,spot`` plus optional ``t`` (one row per price
    change) and ``gpus,gpu_model,gpu_memory_gib``.
    """

    def __init__(self, trend_window_s: float = 6 * 3600.0):
        self._spot: dict[PoolId, _Series] = defaultdict(_Series)
        self._on_demand: dict[PoolId, float] = {}
        self._hardware: dict[str, Hardware] = {}
        self.trend_window_s = trend_window_s

    # -- loading -------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: Path, trend_window_s: float = 6 * 3600.0) -> FilePriceBook:
        book = cls(trend_window_s)
        try:
            text = path.read_text()
        except OSError as exc:
            raise PriceBookError(f"price book {path}: {exc}") from None
        if path.suffix.lower() == ".csv":
            book._load_rows(csv.DictReader(text.splitlines()), str(path))
        else:
            try:
                doc = json.loads(text)
            except json.JSONDecodeError as exc:
                raise PriceBookError(f"price book {path}: not JSON: {exc}") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("pools"), list):
                raise PriceBookError(f"price book {path}: expected an object with a 'pools' list")
            book._load_rows(doc["pools"], str(path))
        return book

    @classmethod
    def demo(cls) -> FilePriceBook:
        return cls.load(DEMO_PRICE_BOOK)

    def _load_rows(self, rows: Iterable[Mapping[str, Any]], source: str) -> None:
        for n, row in enumerate(rows, start=1):
            try:
                self._load_row(row)
            except (KeyError, TypeError, ValueError) as exc:
                raise PriceBookError(f"price book {source}: entry {n}: {exc!r}") from None

    def _load_row(self, row: Mapping[str, Any]) -> None:
        pool = PoolId(str(row["instance_type"]), str(row["zone"]))
        if not pool.instance_type or not pool.zone:
            raise ValueError("instance_type and zone must not be empty")
        if row.get("on_demand") not in (None, ""):
            self._on_demand[pool] = _price(row["on_demand"])
        spot = row.get("spot")
        if isinstance(spot, list):
            for t, price in spot:
                self._spot[pool].add(float(t), _price(price))
        elif spot not in (None, ""):
            self._spot[pool].add(float(row.get("t") or 0.0), _price(spot))
        if row.get("gpus") not in (None, ""):
            self._hardware[pool.instance_type] = Hardware(
                gpus=int(row["gpus"]),
                gpu_model=str(row.get("gpu_model") or ""),
                gpu_memory_gib=float(row.get("gpu_memory_gib") or 0.0),
            )

    # -- queries -------------------------------------------------------------------------------
    def set_spot(self, pool: PoolId, t: float, price: float) -> None:
        """Add a price change (used by tests and the demo's price script)."""
        self._spot[pool].add(t, _price(price))

    @property
    def pools(self) -> tuple[PoolId, ...]:
        return tuple(sorted(set(self._spot) | set(self._on_demand)))

    def hardware(self, instance_type: str) -> Hardware | None:
        return self._hardware.get(instance_type)

    def price_at(self, pool: PoolId, now: float) -> PoolPrice | None:
        series = self._spot.get(pool)
        spot = series.at(now) if series else None
        on_demand = self._on_demand.get(pool)
        if spot is None and on_demand is None:
            return None
        trend = slope_per_hour(series.window(now, self.trend_window_s)) if series else 0.0
        return PoolPrice(pool, spot, on_demand, trend)

    async def prices(self, pools: Sequence[PoolId], now: float) -> dict[PoolId, PoolPrice]:
        out = {}
        for pool in pools:
            price = self.price_at(pool, now)
            if price is not None:
                out[pool] = price
        return out


def _price(value: Any) -> float:
    price = float(value)
    if not price >= 0:  # also rejects NaN
        raise ValueError(f"price must be >= 0, got {value!r}")
    return price


async def spot_price_points(
    client: Any, params: Mapping[str, Any], pools: Sequence[PoolId]
) -> dict[PoolId, list[tuple[float, float]]]:
    """DescribeSpotPriceHistory with ``params``, every page: (seconds, USD/h) points per pool of
    ``pools``, oldest first (the request is types x zones, so it answers for pools not asked for)."""
    wanted = set(pools)
    points: dict[PoolId, list[tuple[float, float]]] = defaultdict(list)
    paginator = client.get_paginator("describe_spot_price_history")
    async with aws_call("DescribeSpotPriceHistory"):
        async for page in paginator.paginate(**params):
            for item in page.get("SpotPriceHistory", []):
                pool = PoolId(item["InstanceType"], item["AvailabilityZone"])
                if pool in wanted:
                    ts = item["Timestamp"]
                    t = ts.timestamp() if isinstance(ts, datetime) else float(ts)
                    points[pool].append((t, float(item["SpotPrice"])))
    for series in points.values():
        series.sort()
    return points


class Ec2SpotPriceSource:
    """Spot prices from DescribeSpotPriceHistory over a recent window, per zone.

    One paginated request covers every instance type; the newest point per pool is the current
    price and a least-squares slope over the window is the trend. On-demand prices are not in
    that API: they come from ``on_demand`` (fleetd/adapters/price_list.py). The reconcile loop
    does not use this window (no policy reads the trend): it reads current prices on a timer,
    fleetd/adapters/spot_prices.py.
    """

    def __init__(
        self,
        client: Any,
        *,
        on_demand: PriceSource | None = None,
        window_s: float = 6 * 3600.0,
        product_description: str = "Linux/UNIX",
        page_size: int = 1000,
    ):
        self._client = client
        self._on_demand = on_demand
        self.window_s = window_s
        self.product_description = product_description
        self.page_size = page_size

    def request_params(self, pools: Sequence[PoolId], now: float) -> dict[str, Any]:
        start = datetime.fromtimestamp(now, UTC) - timedelta(seconds=self.window_s)
        return {
            "InstanceTypes": sorted({p.instance_type for p in pools}),
            "ProductDescriptions": [self.product_description],
            "StartTime": start,
            "EndTime": datetime.fromtimestamp(now, UTC),
            "Filters": [{"Name": "availability-zone", "Values": sorted({p.zone for p in pools})}],
            "PaginationConfig": {"PageSize": self.page_size},
        }

    async def history(self, pools: Sequence[PoolId], now: float) -> dict[PoolId, list[tuple[float, float]]]:
        return await spot_price_points(self._client, self.request_params(pools, now), pools)

    async def prices(self, pools: Sequence[PoolId], now: float) -> dict[PoolId, PoolPrice]:
        history = await self.history(pools, now)
        on_demand = await self._on_demand.prices(pools, now) if self._on_demand else {}
        out: dict[PoolId, PoolPrice] = {}
        for pool in pools:
            series = history.get(pool, [])
            od = on_demand.get(pool)
            spot = series[-1][1] if series else None
            if spot is None and od is None:
                continue
            out[pool] = PoolPrice(
                pool,
                spot,
                od.on_demand if od else None,
                slope_per_hour(series),
            )
        return out
