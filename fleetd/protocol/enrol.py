"""Node enrolment on the wire: an agent trades its instance identity document for a short-lived
MQTT client certificate (CN = its instance id). Versioned pydantic models, JSON over HTTP.

    agent ── POST /v1/enrol {document, signature, csr_pem} ──> controller (fleetd/identity)
          <── 200 {cert_pem, ca_pem, not_after}  |  403 {reason}  |  400 {reason}

Nothing here is secret: the document and its signature come from IMDS and prove only that the
caller can read that instance's metadata; the CSR carries the public half of a key that never
leaves the node. The controller's checks (fleetd/identity/rules.py) decide who gets a certificate.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from fleetd.protocol.errors import ProtocolError

SCHEMA_VERSION = 1
ENROL_PATH = "/v1/enrol"
# IMDS paths of the instance identity document and its base64 RSA-SHA256 signature (verified with
# the region's "RSA" AWS public certificate, as `openssl dgst -sha256 -verify` does).
DOCUMENT_PATH = "/latest/dynamic/instance-identity/document"
SIGNATURE_PATH = "/latest/dynamic/instance-identity/signature"
MAX_REQUEST_BYTES = 16 * 1024  # a document is ~500 bytes, a P-256 CSR ~400


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()


class EnrolRequest(_Wire):
    document: Annotated[str, Field(min_length=2, max_length=8192)]  # exactly as IMDS served it
    signature: Annotated[str, Field(min_length=4, max_length=4096)]  # base64, as IMDS served it
    csr_pem: Annotated[str, Field(min_length=16, max_length=8192)]


class EnrolResponse(_Wire):
    cert_pem: str
    ca_pem: str
    not_after: AwareDatetime


class EnrolRefusal(_Wire):
    reason: Annotated[str, Field(max_length=500)]


class IdentityDocument(BaseModel):
    """The fields of EC2's instance identity document fleetd relies on (AWS adds others:
    accountId, architecture, imageId, billingProducts... kept but not used)."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)
    instance_id: Annotated[str, Field(alias="instanceId", pattern=r"^i-[0-9a-f]{8,32}$")]
    region: Annotated[str, Field(min_length=1, max_length=32)]
    availability_zone: Annotated[str, Field(alias="availabilityZone", max_length=32)] = ""
    instance_type: Annotated[str, Field(alias="instanceType", max_length=64)] = ""
    account_id: Annotated[str, Field(alias="accountId", max_length=32)] = ""
    pending_time: Annotated[datetime, Field(alias="pendingTime")]


def parse_model(model: type[_Wire], raw: bytes | str) -> _Wire:
    try:
        value = model.model_validate_json(raw)
    except ValidationError as err:
        raise ProtocolError(f"bad {model.__name__}: {err.errors(include_url=False)[:3]}") from None
    if value.schema_version > SCHEMA_VERSION:
        raise ProtocolError(f"{model.__name__} schema_version {value.schema_version} is newer than this build")
    return value


def parse_document(raw: str) -> IdentityDocument:
    try:
        doc = IdentityDocument.model_validate_json(raw)
    except ValidationError as err:
        raise ProtocolError(f"bad instance identity document: {err.errors(include_url=False)[:3]}") from None
    if doc.pending_time.tzinfo is None:
        raise ProtocolError("instance identity document pendingTime has no time zone")
    return doc
