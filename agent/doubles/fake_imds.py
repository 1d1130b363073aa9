"""A fake EC2 instance metadata service (IMDSv2 only) for tests and the local demo.

It serves the real paths with the real token rules:
- ``PUT /latest/api/token`` needs ``X-aws-ec2-metadata-token-ttl-seconds`` (1..21600), else 400;
- every GET needs a valid, unexpired ``X-aws-ec2-metadata-token``, else 401;
- ``spot/instance-action`` and ``events/recommendations/rebalance`` answer 404 until something
  has been scheduled and its time has come.

Tests drive it in-process (``FakeImds``: schedule signals, inject faults, read request counts);
the demo runs one per simulated node with ``python -m agent.doubles.fake_imds --port P --instance-id ...``
and drives it over a small control API under ``/_fake/`` on the same port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import signal
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from aiohttp import web

from agent.doubles.fake_iid import IdentitySigner
from agent.node.imds import (
    IDENTITY_PATHS,
    INSTANCE_ACTION_PATH,
    REBALANCE_PATH,
    TOKEN_HEADER,
    TOKEN_PATH,
    TTL_HEADER,
)
from fleetd.protocol.enrol import DOCUMENT_PATH, SIGNATURE_PATH

FaultKind = Literal["500", "timeout", "garbage", "401"]
FAULT_KINDS: tuple[str, ...] = ("500", "timeout", "garbage", "401")
MAX_TTL_S = 21600
GARBAGE = b"<html>\x00 not json {{"  # valid UTF-8, not a valid answer


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Fault:
    kind: str
    remaining: int
    path_prefix: str


@dataclass
class _Scheduled:
    visible_at: float  # wall-clock epoch seconds
    body: dict[str, Any]


@dataclass
class FakeImds:
    """One instance's metadata service. ``await start()`` binds it; ``url`` is then set."""

    instance_id: str = "i-0123456789abcdef0"
    instance_type: str = "g5.xlarge"
    zone: str = "us-east-1a"
    lifecycle: str = "spot"
    local_ipv4: str = "127.0.0.1"
    # Signs /latest/dynamic/instance-identity/{document,signature} (None: those paths answer 404).
    signer: IdentitySigner | None = None
    pending_time: float | None = None  # the instance's launch (epoch s); default: when this started
    timeout_fault_s: float = 5.0  # how long a "timeout" fault stalls (longer than the client waits)
    url: str = ""
    # GET counts per path (only requests that reached a metadata path with a valid token).
    requests: Counter[str] = field(default_factory=Counter)
    token_requests: int = 0
    rejected_401: int = 0
    _tokens: dict[str, float] = field(default_factory=dict)  # token -> monotonic expiry
    _notice: _Scheduled | None = None
    _rebalance: _Scheduled | None = None
    _faults: list[_Fault] = field(default_factory=list)
    _runner: web.AppRunner | None = None

    # ------------------------------------------------------------------ test/demo API
    def schedule_notice(
        self,
        *,
        at: float | None = None,
        in_s: float = 0.0,
        action: str = "terminate",
        action_in_s: float = 120.0,
    ) -> float:
        """Make ``spot/instance-action`` appear at epoch ``at`` (default: now + ``in_s``).

        The action time is ``action_in_s`` after that (AWS gives two minutes). Returns ``at``.
        """
        at = time.time() + in_s if at is None else at
        self._notice = _Scheduled(at, {"action": action, "time": _iso(at + action_in_s)})
        return at

    def schedule_rebalance(self, *, at: float | None = None, in_s: float = 0.0) -> float:
        at = time.time() + in_s if at is None else at
        self._rebalance = _Scheduled(at, {"noticeTime": _iso(at)})
        return at

    def clear_signals(self) -> None:
        self._notice = None
        self._rebalance = None

    def inject(self, kind: str, *, count: int = 1, path_prefix: str = "/latest/meta-data/") -> None:
        """The next ``count`` matching GETs answer with the fault instead of the real answer."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; one of {FAULT_KINDS}")
        self._faults.append(_Fault(kind, count, path_prefix))

    def expire_tokens(self) -> None:
        """Every issued token stops working now (as if it had reached its TTL)."""
        self._tokens.clear()

    def stats(self) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "token_requests": self.token_requests,
            "rejected_401": self.rejected_401,
            "pending_faults": sum(f.remaining for f in self._faults),
        }

    # ------------------------------------------------------------------ server
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_put(TOKEN_PATH, self._put_token)
        app.router.add_get("/latest/meta-data/{tail:.*}", self._get_metadata)
        app.router.add_get("/latest/dynamic/{tail:.*}", self._get_metadata)
        app.router.add_post("/_fake/{op}", self._control)
        app.router.add_get("/_fake/stats", self._control_stats)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0][1]
        self.url = f"http://{host}:{bound}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeImds:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ handlers
    async def _put_token(self, request: web.Request) -> web.Response:
        raw = request.headers.get(TTL_HEADER)
        try:
            ttl = int(raw) if raw is not None else 0
        except ValueError:
            ttl = 0
        if not 1 <= ttl <= MAX_TTL_S:
            return web.Response(status=400, text="missing or invalid TTL header")
        self.token_requests += 1
        token = secrets.token_urlsafe(42)
        self._tokens[token] = time.monotonic() + ttl
        return web.Response(text=token, headers={TTL_HEADER: str(ttl)})

    def _token_valid(self, token: str | None) -> bool:
        if token is None:
            return False
        expiry = self._tokens.get(token)
        if expiry is None:
            return False
        if time.monotonic() >= expiry:
            del self._tokens[token]
            return False
        return True

    def _take_fault(self, path: str) -> str | None:
        for fault in self._faults:
            if path.startswith(fault.path_prefix) and fault.remaining > 0:
                fault.remaining -= 1
                if fault.remaining == 0:
                    self._faults.remove(fault)
                return fault.kind
        return None

    async def _get_metadata(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if not self._token_valid(request.headers.get(TOKEN_HEADER)):
            self.rejected_401 += 1
            return web.Response(status=401, text="Unauthorized")
        self.requests[path] += 1
        fault = self._take_fault(path)
        if fault == "500":
            return web.Response(status=500, text="Internal Server Error")
        if fault == "401":
            return web.Response(status=401, text="Unauthorized")
        if fault == "timeout":
            await asyncio.sleep(self.timeout_fault_s)
        if fault == "garbage":
            return web.Response(body=GARBAGE, content_type="text/plain")
        body = self._answer(path)
        if body is None:
            return web.Response(status=404, text="Not Found")
        return web.Response(text=body, content_type="text/plain")

    def _answer(self, path: str) -> str | None:
        identity = {
            IDENTITY_PATHS["instance_id"]: self.instance_id,
            IDENTITY_PATHS["instance_type"]: self.instance_type,
            IDENTITY_PATHS["zone"]: self.zone,
            IDENTITY_PATHS["lifecycle"]: self.lifecycle,
            IDENTITY_PATHS["local_ipv4"]: self.local_ipv4,
        }
        if path in identity:
            return identity[path]
        if path == "/latest/meta-data/placement/region":
            from fleetd.shared.aws_region import region_of_zone

            return region_of_zone(self.zone)
        if path in (DOCUMENT_PATH, SIGNATURE_PATH):
            return self._identity_document(path)
        now = time.time()
        if path == INSTANCE_ACTION_PATH:
            sched = self._notice
        elif path == REBALANCE_PATH:
            sched = self._rebalance
        else:
            return None
        if sched is None or now < sched.visible_at:
            return None
        return json.dumps(sched.body)

    def _identity_document(self, path: str) -> str | None:
        if self.signer is None:
            return None
        if self.pending_time is None:
            self.pending_time = time.time()
        # Static for the instance's life, like the real one (which is why replays must be handled).
        doc = IdentitySigner.document(
            instance_id=self.instance_id,
            instance_type=self.instance_type,
            zone=self.zone,
            private_ip=self.local_ipv4,
            pending_time=self.pending_time,
        )
        return doc if path == DOCUMENT_PATH else self.signer.sign(doc)

    async def _control(self, request: web.Request) -> web.Response:
        op = request.match_info["op"]
        try:
            body = await request.json() if request.can_read_body else {}
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
            if op == "notice":
                at = self.schedule_notice(
                    in_s=float(body.get("in_s", 0.0)),
                    action=str(body.get("action", "terminate")),
                    action_in_s=float(body.get("action_in_s", 120.0)),
                )
                return web.json_response({"visible_at": at})
            if op == "rebalance":
                return web.json_response({"visible_at": self.schedule_rebalance(in_s=float(body.get("in_s", 0.0)))})
            if op == "fault":
                self.inject(
                    str(body.get("kind")),
                    count=int(body.get("count", 1)),
                    path_prefix=str(body.get("path_prefix", "/latest/meta-data/")),
                )
                return web.json_response({"ok": True})
            if op == "expire-tokens":
                self.expire_tokens()
                return web.json_response({"ok": True})
            if op == "clear":
                self.clear_signals()
                return web.json_response({"ok": True})
        except (ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"error": f"unknown operation {op!r}"}, status=404)

    async def _control_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())


def control(url: str, op: str, **body: Any) -> dict[str, Any]:
    """Drive a standalone fake IMDS from another process (the demo): ``control(url, "notice")``."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(
        f"{url.rstrip('/')}/_fake/{op}", data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


async def _serve(args: argparse.Namespace) -> None:
    fake = FakeImds(
        instance_id=args.instance_id,
        instance_type=args.instance_type,
        zone=args.zone,
        lifecycle=args.lifecycle,
        local_ipv4=args.local_ipv4,
    )
    url = await fake.start(args.host, args.port)
    print(json.dumps({"fake_imds": url, "instance_id": args.instance_id}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await fake.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.doubles.fake_imds", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--instance-id", default="i-0123456789abcdef0")
    p.add_argument("--instance-type", default="g5.xlarge")
    p.add_argument("--zone", default="us-east-1a")
    p.add_argument("--lifecycle", default="spot", choices=["spot", "on-demand"])
    p.add_argument("--local-ipv4", default="127.0.0.1")
    asyncio.run(_serve(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
