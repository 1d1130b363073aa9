"""IMDSv2 client: session token, instance identity, and the two spot signals.

The watcher must never die of what IMDS answers (a known pain of the AWS Node Termination
Handler): timeouts, 401s, 5xx and garbage bodies are logged and retried. 404 on the two signal
paths is the normal "nothing pending" answer.

Token rules (IMDSv2): ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``
returns a token valid for that many seconds; every GET carries ``X-aws-ec2-metadata-token``. The
token is refreshed before it expires and re-fetched whenever IMDS answers 401 (it may have been
invalidated early, e.g. by a metadata service restart).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, cast

import aiohttp
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError
from tenacity import RetryCallState

from fleetd.shared.backoff import failure_of, retrying
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

TOKEN_PATH = "/latest/api/token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
IDENTITY_PATHS = {
    "instance_id": "/latest/meta-data/instance-id",
    "instance_type": "/latest/meta-data/instance-type",
    "zone": "/latest/meta-data/placement/availability-zone",
    "lifecycle": "/latest/meta-data/instance-life-cycle",
    "local_ipv4": "/latest/meta-data/local-ipv4",
}
# Body sizes of the paths we read are tiny; anything bigger is garbage, not worth reading.
MAX_BODY_BYTES = 64 * 1024


class ImdsError(Exception):
    """IMDS could not give a usable answer this time (timeout, 5xx, 401 twice, garbage)."""


class ImdsNotFound(ImdsError):
    """404: the path has nothing (for the signal paths: nothing pending)."""


@dataclass(frozen=True, slots=True)
class Identity:
    instance_id: str
    instance_type: str
    zone: str
    lifecycle: Literal["spot", "on-demand", "unknown"]
    local_ipv4: str


class InstanceAction(BaseModel):
    """Body of ``spot/instance-action``: ``{"action": "terminate", "time": "...Z"}``."""

    model_config = ConfigDict(frozen=True)  # AWS may add fields; ignore them

    action: Literal["terminate", "stop", "hibernate"]
    time: AwareDatetime


class RebalanceRecommendation(BaseModel):
    """Body of ``events/recommendations/rebalance``: ``{"noticeTime": "...Z"}``."""

    model_config = ConfigDict(frozen=True)

    notice_time: AwareDatetime = Field(alias="noticeTime")


def _lifecycle(text: str) -> Literal["spot", "on-demand", "unknown"]:
    # IMDS says "spot" or "on-demand" (older docs: "scheduled"); anything else is unknown.
    text = text.strip()
    return text if text in ("spot", "on-demand") else "unknown"  # type: ignore[return-value]


class ImdsClient:
    """One aiohttp session to IMDS with token handling. Use as an async context manager."""

    def __init__(
        self,
        base_url: str = "http://169.254.169.254",
        *,
        token_ttl_s: int = 21600,
        timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token_ttl_s = token_ttl_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._token: str | None = None
        self._token_expires_at = 0.0
        self._token_lock = asyncio.Lock()

    async def __aenter__(self) -> ImdsClient:
        # IMDS is link-local: never go through an HTTP proxy from the environment.
        self._session = aiohttp.ClientSession(timeout=self.timeout, trust_env=False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ token
    def _refresh_margin_s(self) -> float:
        # Refresh well before expiry so a GET never races the token's last second.
        return min(60.0, self.token_ttl_s / 4)

    def _token_fresh(self) -> bool:
        return self._token is not None and self._clock() < self._token_expires_at - self._refresh_margin_s()

    async def _get_token(self) -> str:
        async with self._token_lock:
            if self._token_fresh():
                assert self._token is not None
                return self._token
            assert self._session is not None, "use ImdsClient as an async context manager"
            started = self._clock()
            try:
                async with self._session.put(
                    self.base_url + TOKEN_PATH, headers={TTL_HEADER: str(self.token_ttl_s)}
                ) as resp:
                    body = await resp.content.read(MAX_BODY_BYTES + 1)
                    if resp.status != 200:
                        raise ImdsError(f"token request answered HTTP {resp.status}")
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise ImdsError(f"token request failed: {exc!r}") from None
            token = body.decode("ascii", "replace").strip()
            if not token or len(body) > MAX_BODY_BYTES or not token.isprintable():
                raise ImdsError("token request returned an unusable body")
            self._token = token
            self._token_expires_at = started + self.token_ttl_s
            log.debug("imds_token_refreshed", ttl_s=self.token_ttl_s)
            return token

    def _forget_token(self, token: str) -> None:
        if self._token == token:
            self._token = None

    # ------------------------------------------------------------------ GET
    async def get_text(self, path: str) -> str:
        """GET one metadata path. Raises ImdsNotFound on 404, ImdsError on anything unusable."""
        assert self._session is not None, "use ImdsClient as an async context manager"
        for attempt in (1, 2):
            token = await self._get_token()
            try:
                async with self._session.get(self.base_url + path, headers={TOKEN_HEADER: token}) as resp:
                    body = await resp.content.read(MAX_BODY_BYTES + 1)
                    status = resp.status
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise ImdsError(f"GET {path} failed: {exc!r}") from None
            if status == 401:
                # Token expired early or was invalidated: fetch a new one and retry once.
                self._forget_token(token)
                if attempt == 1:
                    log.info("imds_token_rejected", path=path)
                    continue
                raise ImdsError(f"GET {path} answered 401 with a fresh token")
            if status == 404:
                raise ImdsNotFound(path)
            if status != 200:
                raise ImdsError(f"GET {path} answered HTTP {status}")
            if len(body) > MAX_BODY_BYTES:
                raise ImdsError(f"GET {path} body larger than {MAX_BODY_BYTES} bytes")
            try:
                return body.decode("utf-8")
            except UnicodeDecodeError:
                raise ImdsError(f"GET {path} body is not UTF-8") from None
        raise AssertionError("unreachable")

    async def identity(self) -> Identity:
        values = {}
        for field, path in IDENTITY_PATHS.items():
            try:
                values[field] = (await self.get_text(path)).strip()
            except ImdsNotFound:
                if field == "instance_id":
                    raise ImdsError("instance-id is missing") from None
                values[field] = ""  # e.g. no local-ipv4 in some VPC setups
        instance_id = values["instance_id"]
        if not instance_id or len(instance_id) > 64 or not instance_id.replace("-", "").isalnum():
            raise ImdsError(f"instance-id {instance_id[:80]!r} is not an instance id")
        return Identity(
            instance_id=instance_id,
            instance_type=values["instance_type"][:64],
            zone=values["zone"][:64],
            lifecycle=_lifecycle(values["lifecycle"]),
            local_ipv4=values["local_ipv4"][:64],
        )

    async def instance_action(self) -> InstanceAction | None:
        """The pending interruption, or None (404). Raises ImdsError on a bad answer."""
        try:
            body = await self.get_text(INSTANCE_ACTION_PATH)
        except ImdsNotFound:
            return None
        try:
            return InstanceAction.model_validate_json(body)
        except ValidationError as exc:
            raise ImdsError(f"malformed instance-action body: {_short(body)} ({exc.error_count()} errors)") from None

    async def rebalance(self) -> RebalanceRecommendation | None:
        try:
            body = await self.get_text(REBALANCE_PATH)
        except ImdsNotFound:
            return None
        try:
            return RebalanceRecommendation.model_validate_json(body)
        except ValidationError as exc:
            raise ImdsError(f"malformed rebalance body: {_short(body)} ({exc.error_count()} errors)") from None


def _short(body: str, limit: int = 120) -> str:
    return repr(body[:limit]) + ("..." if len(body) > limit else "")


async def read_identity(client: ImdsClient, *, retry_s: float = 1.0, max_retry_s: float = 10.0) -> Identity:
    """Read the identity, retrying (with backoff) until IMDS gives a usable answer.

    The agent cannot name itself on MQTT without its instance id, so there is nothing better to do
    than wait; each failure is logged.
    """

    def failed(state: RetryCallState) -> None:
        log.warning("imds_identity_failed", error=str(failure_of(state)), retry_in_s=state.upcoming_sleep)

    async for attempt in retrying(retry_s, max_retry_s, retry_on=ImdsError, before_sleep=failed):
        with attempt:
            ident = await client.identity()
    log.info(
        "imds_identity",
        instance_id=ident.instance_id,
        instance_type=ident.instance_type,
        zone=ident.zone,
        lifecycle=ident.lifecycle,
    )
    return ident


# ---------------------------------------------------------------------- watcher
@dataclass(frozen=True, slots=True)
class SpotSignal:
    """What the watcher saw: exactly one of the two fields is set."""

    action: InstanceAction | None = None
    rebalance: RebalanceRecommendation | None = None


OnSignal = Callable[[SpotSignal], Awaitable[None]]


class SpotWatcher:
    """Polls both signal paths every ``interval_s`` and reports each distinct signal once.

    A signal is reported again only if its content changes (e.g. a new action time); the same
    notice seen on every poll is not re-published.
    """

    def __init__(self, client: ImdsClient, on_signal: OnSignal, *, interval_s: float = 0.5) -> None:
        self.client = client
        self.on_signal = on_signal
        self.interval_s = interval_s
        self._last_action: InstanceAction | None = None
        self._last_rebalance: RebalanceRecommendation | None = None
        self._failing: dict[str, str] = {}
        self.polls = 0

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            await self.poll_once()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def poll_once(self) -> None:
        self.polls += 1
        # Both paths concurrently: one slow path (timeout) must not delay the other.
        read_action, read_rebalance = await asyncio.gather(
            self._read("instance-action", self.client.instance_action),
            self._read("rebalance", self.client.rebalance),
        )
        if read_action is not _FAILED:
            action = cast("InstanceAction | None", read_action)  # what instance_action returns
            if action is not None and action != self._last_action:
                log.warning("imds_instance_action", action=action.action, time=action.time.isoformat())
                await self.on_signal(SpotSignal(action=action))
            self._last_action = action
        if read_rebalance is not _FAILED:
            rebalance = cast("RebalanceRecommendation | None", read_rebalance)  # what rebalance returns
            if rebalance is not None and rebalance != self._last_rebalance:
                log.warning("imds_rebalance_recommendation", notice_time=rebalance.notice_time.isoformat())
                await self.on_signal(SpotSignal(rebalance=rebalance))
            self._last_rebalance = rebalance

    async def _read(self, name: str, fetch: Callable[[], Awaitable[object]]) -> object:
        try:
            value = await fetch()
        except ImdsError as exc:
            # Log the first failure of a streak and every change of error, not every poll.
            if self._failing.get(name) != str(exc):
                log.warning("imds_poll_failed", path=name, error=str(exc))
            self._failing[name] = str(exc)
            return _FAILED
        if name in self._failing:
            log.info("imds_poll_recovered", path=name)
            del self._failing[name]
        return value


_FAILED = object()
