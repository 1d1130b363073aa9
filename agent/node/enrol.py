"""The node's MQTT identity: a client certificate with CN = its instance id, from the controller.

At boot the agent reads its signed instance identity document from IMDS, makes (once; kept in
state_dir, mode 0600) an EC P-256 key, and POSTs document + signature + CSR to the controller's
enrolment endpoint (fleetd/identity). The certificate is short-lived; ``run()`` renews it at two
thirds of its life, with the same key (the controller renews only for the key it first bound).
The MQTT session reads the files at every (re)connect, so a renewed certificate is picked up by
the next connection. Nothing secret is baked into the image: the key is born on the node.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tenacity import RetryCallState

from agent.node.imds import ImdsClient, ImdsError
from fleetd.protocol.enrol import (
    DOCUMENT_PATH,
    ENROL_PATH,
    SIGNATURE_PATH,
    EnrolRefusal,
    EnrolRequest,
    EnrolResponse,
    parse_model,
)
from fleetd.protocol.errors import ProtocolError
from fleetd.shared.backoff import failure_of, retrying
from fleetd.shared.logs import get_logger
from fleetd.shared.settings import MqttConfig

log = get_logger(__name__)
RENEW_AT = 2 / 3  # of the certificate's life
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 30.0


class EnrolFailed(Exception):
    """No certificate this time (refused, controller unreachable, IMDS unusable)."""


@dataclass(frozen=True)
class IdentityFiles:
    directory: Path

    @property
    def key(self) -> Path:
        return self.directory / "node.key"

    @property
    def cert(self) -> Path:
        return self.directory / "node.crt"

    @property
    def ca(self) -> Path:
        return self.directory / "ca.crt"


def _write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def mqtt_with_identity(mqtt: MqttConfig, files: IdentityFiles) -> MqttConfig:
    """The broker connection with the enrolled certificate. The broker's CA comes from our own
    config when given (pinned, e.g. baked into the image: it is public), else from enrolment."""
    return mqtt.model_copy(update={"cert_file": files.cert, "key_file": files.key, "ca_file": mqtt.ca_file or files.ca})


def load_or_make_key(path: Path) -> ec.EllipticCurvePrivateKey:
    if path.exists():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if isinstance(key, ec.EllipticCurvePrivateKey):
            return key
        log.warning("node_key_replaced", path=str(path), why="not an EC key")
    key = ec.generate_private_key(ec.SECP256R1())
    _write(
        path,
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        0o600,
    )
    return key


def make_csr(key: ec.EllipticCurvePrivateKey, instance_id: str) -> str:
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, instance_id)]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode()


def endpoint_of(enrol_url: str) -> str:
    """``node.enrol_url`` may name the controller (``http://10.0.1.10:8440``, as the node's own
    config has it) or its endpoint (``.../v1/enrol``, as fleetd's launch template and
    ``enrol.public_url`` write it): both reach the one endpoint. (Before, the launch template's
    form got the path twice and every enrolment was answered 404; found by the deploy-box flow.)"""
    base = enrol_url.rstrip("/")
    return base if base.endswith(ENROL_PATH) else base + ENROL_PATH


class NodeEnrolment:
    def __init__(
        self, enrol_url: str, imds: ImdsClient, instance_id: str, directory: Path, *, timeout_s: float = 10.0
    ) -> None:
        self.url = endpoint_of(enrol_url)
        self.imds = imds
        self.instance_id = instance_id
        self.files = IdentityFiles(directory)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.not_after: datetime | None = None
        self.received_at: datetime | None = None
        self.enrolments = 0

    async def enrol_once(self) -> EnrolResponse:
        try:
            document = await self.imds.get_text(DOCUMENT_PATH)
            signature = (await self.imds.get_text(SIGNATURE_PATH)).strip()
        except ImdsError as exc:
            raise EnrolFailed(f"instance identity document unavailable: {exc}") from None
        key = await asyncio.to_thread(load_or_make_key, self.files.key)
        req = EnrolRequest(document=document, signature=signature, csr_pem=make_csr(key, self.instance_id))
        try:
            # The controller is inside the VPC: never through an HTTP proxy from the environment.
            async with aiohttp.ClientSession(timeout=self.timeout, trust_env=False) as http:
                async with http.post(
                    self.url, data=req.to_json(), headers={"Content-Type": "application/json"}
                ) as resp:
                    body = await resp.content.read(64 * 1024)
                    status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EnrolFailed(f"enrolment endpoint {self.url} unreachable: {exc!r}") from None
        try:
            if status != 200:
                reason = parse_model(EnrolRefusal, body).reason  # type: ignore[attr-defined]
                raise EnrolFailed(f"enrolment refused (HTTP {status}): {reason}")
            answer = parse_model(EnrolResponse, body)
        except ProtocolError as exc:
            raise EnrolFailed(f"enrolment answered HTTP {status} with an unusable body: {exc}") from None
        assert isinstance(answer, EnrolResponse)
        cert = x509.load_pem_x509_certificate(answer.cert_pem.encode())
        if cert.public_key() != key.public_key():
            raise EnrolFailed("the certificate returned is not for this node's key")
        await asyncio.to_thread(_write, self.files.cert, answer.cert_pem.encode(), 0o644)
        await asyncio.to_thread(_write, self.files.ca, answer.ca_pem.encode(), 0o644)
        self.not_after, self.received_at = answer.not_after, datetime.now(UTC)
        self.enrolments += 1
        log.info("node_certificate_received", not_after=answer.not_after.isoformat(), enrolments=self.enrolments)
        return answer

    async def ensure(self, stop: asyncio.Event | None = None) -> EnrolResponse:
        """Enrol, retrying with backoff until it works (the controller may start after us)."""

        def failed(state: RetryCallState) -> None:
            delay = round(state.upcoming_sleep, 1)
            log.warning("node_enrolment_failed", error=str(failure_of(state))[:500], retry_in_s=delay)

        try:
            async for attempt in retrying(
                RETRY_FIRST_S, RETRY_MAX_S, retry_on=EnrolFailed, jitter=0.2, stop=stop, before_sleep=failed
            ):
                if attempt.retry_state.attempt_number > 1 and stop is not None and stop.is_set():
                    break  # it came during the wait
                with attempt:
                    return await self.enrol_once()
        except EnrolFailed:
            if stop is not None and stop.is_set():
                raise EnrolFailed("stopped before enrolment succeeded") from None
            raise
        raise EnrolFailed("stopped before enrolment succeeded")

    def renew_in_s(self, now: datetime) -> float:
        """Two thirds into the life left when it arrived (notBefore is backdated for clock skew)."""
        if self.not_after is None or self.received_at is None:
            return 0.0
        life = (self.not_after - self.received_at).total_seconds()
        return max(0.0, (self.received_at.timestamp() + life * RENEW_AT) - now.timestamp())

    async def run(self) -> None:
        """Renew before expiry, forever (cancelled with the agent)."""
        while True:
            await asyncio.sleep(self.renew_in_s(datetime.now(UTC)))
            await self.ensure()


async def enrol_and_renew(enrolment: NodeEnrolment, ready: asyncio.Event) -> None:
    """Get the node's certificate (retrying until the controller answers), let the MQTT session
    connect with it, then renew it before it ends, for the life of the agent."""
    await enrolment.ensure()
    ready.set()
    await enrolment.run()


def enrolment_for(
    enrol_url: str | None, state_dir: Path, mqtt: MqttConfig, imds: ImdsClient, instance_id: str
) -> tuple[NodeEnrolment | None, MqttConfig, asyncio.Event | None]:
    """With an ``enrol_url``: the enrolment, the broker connection with its certificate, and the
    event the MQTT session waits on before connecting. Without: the configured broker as it is."""
    if not enrol_url:
        return None, mqtt, None
    enrolment = NodeEnrolment(enrol_url, imds, instance_id, state_dir / "identity")
    return enrolment, mqtt_with_identity(mqtt, enrolment.files), asyncio.Event()
