"""Fault injection in front of moto: a small HTTP proxy that answers like AWS does when it fails.

moto's fleets never fail and it never throttles, so tests and the local demo put this proxy
between the adapters and moto. Rules (``fail``, ``drop``, ``hold``) pick an operation and answer
with AWS's real payloads; the price APIs moto lacks or fakes are answered here too, when given
(fleetd/adapters/pricing_fake.py). Everything else is forwarded unchanged.
(docs/DESIGN.md "Start-up and the production path", "Prices")
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

import aiohttp
from aiohttp import web

from fleetd.adapters.aws_payloads import (
    JSON_HTTP_STATUS,
    create_fleet_response,
    error_response,
    fleet_overrides,
    json_response,
    with_overrides,
)
from fleetd.adapters.pricing_fake import PriceListFake, SpotPriceFake
from fleetd.policy.model import PoolId
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

PRICING_TARGET = "AWSPriceListService."
QUOTAS_TARGET = "ServiceQuotasV20190624."

# Headers that describe one hop of HTTP, not the answer: aiohttp sets its own.
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}


@dataclass
class FaultRule:
    """Fail ``operation`` (optionally only for ``pool``) with ``code``, ``times`` times (None: always)."""

    operation: str
    code: str
    pool: PoolId | None = None  # CreateFleet only: fail just this pool's overrides
    times: int | None = 1
    hits: int = 0

    def spent(self) -> bool:
        return self.times is not None and self.hits >= self.times


@dataclass
class DropRule:
    """Cut the connection in the middle of the next ``times`` S3 ``operation`` bodies."""

    operation: str  # UploadPart | PutObject
    times: int = 1
    hits: int = 0


@dataclass
class _Hold:
    operation: str
    arrived: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


class FaultProxy:
    """``with FaultProxy(moto_url, zone_of_subnet) as proxy: ...`` then point clients at proxy.url."""

    def __init__(
        self,
        upstream: str,
        zone_of_subnet: Mapping[str, str] | None = None,
        *,
        price_list: PriceListFake | None = None,
        spot_prices: SpotPriceFake | None = None,
        quotas: Mapping[str, float] | None = None,
    ):
        self.upstream = upstream.rstrip("/")
        self.zone_of_subnet = dict(zone_of_subnet or {})
        self.price_list = price_list
        self.spot_prices = spot_prices
        # EC2 service quotas by code (moto's Service Quotas knows VPC only): GetServiceQuota is
        # answered from here; an unknown code is NoSuchResourceException, as AWS answers.
        self.quotas = dict(quotas) if quotas is not None else None
        self._rules: list[FaultRule] = []
        self._holds: list[_Hold] = []
        self._drops: list[DropRule] = []
        self._lock = threading.Lock()
        self.calls: list[tuple[str, dict[str, str]]] = []  # (operation, params) as received
        self.injected: list[tuple[str, str]] = []  # (operation, code) answered with a fault
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self.url = ""

    # -- rules (called from any thread) -------------------------------------------------------
    def fail(self, operation: str, code: str, *, pool: PoolId | None = None, times: int | None = 1) -> FaultRule:
        """Answer ``operation`` with the error ``code`` as AWS does (EC2's ``<Response><Errors>``
        XML and HTTP status: RequestLimitExceeded 503, UnauthorizedOperation 403, ...; the JSON
        protocol's error shape for GetProducts). ``operation="*"``: every EC2 call (a throttled
        account). ``pool`` (an instant CreateFleet): that pool's overrides are removed from what moto
        sees and come back in ``errorSet``, as AWS reports a pool without capacity (HTTP 200)."""
        rule = FaultRule(operation, code, pool, times)
        with self._lock:
            self._rules.append(rule)
        return rule

    def drop(self, operation: str, *, times: int = 1) -> DropRule:
        """S3: read half of the next ``operation`` (UploadPart or PutObject) request's body, then cut
        the connection, as a network failure mid-part does."""
        rule = DropRule(operation, times)
        with self._lock:
            self._drops.append(rule)
        return rule

    def hold(self, operation: str) -> _Hold:
        """Forward the next ``operation`` to moto but hold its answer until ``release`` is set: the
        instances exist, so a controller can be killed between "EC2 launched" and "fleetd recorded
        it"."""
        h = _Hold(operation)
        with self._lock:
            self._holds.append(h)
        return h

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self._drops.clear()
            for h in self._holds:
                h.release.set()
            self._holds.clear()

    def calls_of(self, operation: str) -> list[dict[str, str]]:
        with self._lock:
            return [p for op, p in self.calls if op == operation]

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        # Its own event loop in a thread: it serves a controller in a subprocess as well as one in
        # the test's loop.
        self._thread = threading.Thread(target=self._serve, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("fault proxy did not start")
        return self

    def stop(self) -> None:
        self.clear()
        if self._loop is not None and self._runner is not None:
            fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
            fut.result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        loop.run_until_complete(self._start_app())
        self._started.set()
        loop.run_forever()
        loop.close()

    async def _start_app(self) -> None:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app.on_cleanup.append(lambda _app: self._session.close())
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    # -- request handling -------------------------------------------------------------------------
    def _take_rule(self, operation: str, pools: list[PoolId], *, ec2: bool = True) -> list[FaultRule]:
        """Rules that fire for this call (each fired rule counts one hit); "*" is EC2's only."""
        fired = []
        names = (operation, "*") if ec2 else (operation,)
        with self._lock:
            for rule in self._rules:
                if rule.operation not in names or rule.spent():
                    continue
                if rule.pool is not None and rule.pool not in pools:
                    continue
                rule.hits += 1
                fired.append(rule)
                if rule.pool is None:
                    break  # a call-level fault answers the whole call
        return fired

    def _take_hold(self, operation: str) -> _Hold | None:
        with self._lock:
            for h in self._holds:
                if h.operation == operation and not h.arrived.is_set():
                    return h
        return None

    def _take_drop(self, request: web.Request) -> DropRule | None:
        if request.method != "PUT":
            return None
        operation = "UploadPart" if "partNumber" in request.query else "PutObject"
        with self._lock:
            for rule in self._drops:
                if rule.operation == operation and rule.hits < rule.times:
                    rule.hits += 1
                    self.injected.append((operation, "connection-cut"))
                    return rule
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        drop = self._take_drop(request)
        if drop is not None:
            await request.content.read(max(1, (request.content_length or 2) // 2))
            log.info("fault_injected", operation=drop.operation, code="connection-cut", path=request.path)
            assert request.transport is not None
            request.transport.abort()  # mid-body: the client sees its connection reset
            return web.Response(status=500)
        body = await request.read()
        target = request.headers.get("X-Amz-Target", "")
        if target.startswith(PRICING_TARGET):
            return self._pricing(target.removeprefix(PRICING_TARGET), body)
        if target.startswith(QUOTAS_TARGET) and self.quotas is not None:
            return self._quota(target.removeprefix(QUOTAS_TARGET), body)
        form = request.content_type == "application/x-www-form-urlencoded"  # EC2's query API, not S3 data
        params = dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True)) if body and form else {}
        operation = params.get("Action", "")
        with self._lock:
            self.calls.append((operation, params))
        overrides = fleet_overrides(params) if operation == "CreateFleet" else []
        pools = [self._pool(o) for o in overrides]
        fired = self._take_rule(operation, [p for p in pools if p is not None])
        call_level = next((r for r in fired if r.pool is None), None)
        if call_level is not None:
            with self._lock:
                self.injected.append((operation, call_level.code))
            log.info("fault_injected", operation=operation, code=call_level.code)
            return error_response(call_level.code, pools[0] if pools else None)
        if operation == "DescribeSpotPriceHistory" and self.spot_prices is not None:
            return web.Response(text=self.spot_prices.describe(params), status=200, content_type="text/xml")
        failing = {r.pool: r.code for r in fired if r.pool is not None}
        errors: list[tuple[dict[str, str], str, PoolId]] = []
        if failing:
            keep = [o for o, p in zip(overrides, pools, strict=True) if p not in failing]
            errors = [(o, failing[p], p) for o, p in zip(overrides, pools, strict=True) if p in failing]
            with self._lock:
                self.injected.extend((operation, code) for _, code, _ in errors)
            log.info("fault_injected", operation=operation, failed_pools=[str(p) for p in failing])
            if not keep:
                return create_fleet_response(params, errors, upstream_xml=None)
            body = with_overrides(params, keep).encode()
        hold = self._take_hold(operation)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=body, headers=headers
        ) as upstream:
            payload = await upstream.read()
            status = upstream.status
            ctype = upstream.headers.get("Content-Type", "text/xml")
            passed = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
        if hold is not None:
            hold.arrived.set()
            await asyncio.get_running_loop().run_in_executor(None, hold.release.wait)
        if errors and status == 200:
            return create_fleet_response(params, errors, upstream_xml=payload.decode())
        if not form and operation == "":
            # S3: its answers live in headers too (ETag, Content-Length of a HEAD, x-amz-*).
            if request.method == "HEAD":
                length = upstream.headers.get("Content-Length")
                return web.Response(status=status, headers={**passed, **({"Content-Length": length} if length else {})})
            return web.Response(body=payload, status=status, headers=passed)
        return web.Response(body=payload, status=status, headers={"Content-Type": ctype})

    def _pricing(self, operation: str, body: bytes) -> web.Response:
        """The Price List API, answered from ``price_list`` (moto has none)."""
        try:
            request = json.loads(body or b"{}")
        except json.JSONDecodeError:
            request = {}
        with self._lock:
            self.calls.append((operation, request))
        fired = self._take_rule(operation, [], ec2=False)
        if fired:
            code = fired[0].code
            with self._lock:
                self.injected.append((operation, code))
            log.info("fault_injected", operation=operation, code=code)
            return json_response(JSON_HTTP_STATUS.get(code, 400), {"__type": code, "Message": f"{code} (injected)"})
        if operation != "GetProducts" or self.price_list is None:
            return json_response(400, {"__type": "UnknownOperationException", "Message": operation})
        status, answer = self.price_list.get_products(request)
        return json_response(status, answer)

    def _quota(self, operation: str, body: bytes) -> web.Response:
        request = json.loads(body or b"{}")
        with self._lock:
            self.calls.append((operation, request))
        fired = self._take_rule(operation, [], ec2=False)
        if fired:
            code = fired[0].code
            return json_response(JSON_HTTP_STATUS.get(code, 400), {"__type": code, "Message": f"{code} (injected)"})
        code = str(request.get("QuotaCode", ""))
        if operation != "GetServiceQuota" or self.quotas is None or code not in self.quotas:
            return json_response(400, {"__type": "NoSuchResourceException", "Message": f"{operation} {code}"})
        quota = {"ServiceCode": "ec2", "QuotaCode": code, "Value": float(self.quotas[code]), "Unit": "None"}
        return json_response(200, {"Quota": quota})

    def _pool(self, override: Mapping[str, str]) -> PoolId | None:
        itype = override.get("InstanceType")
        zone = override.get("AvailabilityZone") or self.zone_of_subnet.get(override.get("SubnetId", ""))
        return PoolId(itype, zone) if itype and zone else None
