"""Enrolment: check an agent's proof of identity, then have the CA sign its certificate.

The checks that need I/O happen here (signature, CSR, EC2's view of the instance through the same
EC2 adapter the reconcile loop uses); the decision is ``rules.judge``. Requests are handled one at
a time so two racing requests for one instance cannot both be "first".
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from fleetd.identity.bindings import BindingStore
from fleetd.identity.ca import CertificateAuthority, pem
from fleetd.identity.iid import DocumentRejected, verify_document
from fleetd.identity.rules import Binding, EnrolSettings, judge
from fleetd.protocol.enrol import EnrolRequest, EnrolResponse
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

# instance id -> its EC2 state if it carries this fleet's tag, else None.
FleetLookup = Callable[[str], Awaitable[str | None]]


class Refused(Exception):
    """No certificate: the reason is safe to tell the requester (it says nothing secret)."""


class LookupUnavailable(Exception):
    """EC2 could not be asked right now; the agent retries."""


def key_fingerprint(key: ec.EllipticCurvePublicKey) -> str:
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


class Enrolment:
    def __init__(
        self,
        ca: CertificateAuthority,
        signer: rsa.RSAPublicKey,
        lookup: FleetLookup,
        settings: EnrolSettings,
        bindings: BindingStore,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ca = ca
        self.signer = signer
        self.lookup = lookup
        self.settings = settings
        self.bindings = bindings
        self.clock = clock
        self.issued = 0
        self.refused = 0
        self._lock = asyncio.Lock()

    async def enrol(self, req: EnrolRequest) -> EnrolResponse:
        try:
            return await self._enrol(req)
        except Refused as exc:
            self.refused += 1
            log.warning("node_certificate_refused", reason=str(exc))
            raise

    async def _enrol(self, req: EnrolRequest) -> EnrolResponse:
        try:
            doc = verify_document(req.document, req.signature, self.signer)
        except DocumentRejected as exc:
            raise Refused(f"identity document rejected: {exc}") from None
        try:
            csr = x509.load_pem_x509_csr(req.csr_pem.encode())
        except ValueError:
            raise Refused("csr_pem is not a PEM certificate signing request") from None
        key = csr.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
            raise Refused("the CSR's key must be EC P-256")
        if not csr.is_signature_valid:
            raise Refused("the CSR is not signed by its own key")
        fingerprint = key_fingerprint(key)
        async with self._lock:
            try:
                state = await self.lookup(doc.instance_id)
            except Exception as exc:  # the adapter raises AwsError; any failure means "ask again"
                raise LookupUnavailable(f"EC2 lookup of {doc.instance_id} failed: {exc}") from None
            now = self.clock()
            reason = judge(doc, state, self.bindings.get(doc.instance_id), fingerprint, now, self.settings)
            if reason is not None:
                raise Refused(reason)
            lifetime = timedelta(seconds=self.settings.cert_lifetime_s)
            cert = await self.ca.issue_client(doc.instance_id, key, lifetime, datetime.fromtimestamp(now, UTC))
            not_after = cert.not_valid_after_utc
            await asyncio.to_thread(
                self.bindings.put, doc.instance_id, Binding(fingerprint, not_after.timestamp()), now
            )
        self.issued += 1
        log.info(
            "node_certificate_issued",
            instance_id=doc.instance_id,
            not_after=not_after.isoformat(),
            serial=format(cert.serial_number, "x"),
        )
        return EnrolResponse(cert_pem=pem(cert).decode(), ca_pem=self.ca.ca_pem().decode(), not_after=not_after)
