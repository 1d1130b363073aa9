"""Verify an EC2 instance identity document against AWS's public certificate for the region.

The ``/signature`` IMDS path serves a base64 RSA signature of the SHA-256 of the document's exact
bytes (PKCS#1 v1.5, what ``openssl dgst -sha256 -verify`` checks). The certificate is AWS's
published regional "RSA" certificate (docs.aws.amazon.com/AWSEC2/latest/UserGuide/regions-certs.html),
configured as a file; the demo and the tests configure a test certificate whose key signs the fake
IMDS's documents.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from fleetd.protocol.enrol import IdentityDocument, parse_document
from fleetd.protocol.errors import ProtocolError


class DocumentRejected(Exception):
    """The document is not AWS's (bad signature) or not a document at all."""


def load_signer_certificate(path: Path) -> rsa.RSAPublicKey:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    key = cert.public_key()
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError(f"{path}: the identity document certificate must be an RSA certificate")
    return key


def verify_document(document: str, signature_b64: str, signer: rsa.RSAPublicKey) -> IdentityDocument:
    try:
        signature = base64.b64decode("".join(signature_b64.split()), validate=True)
    except (binascii.Error, ValueError):
        raise DocumentRejected("signature is not base64") from None
    try:
        signer.verify(signature, document.encode(), padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        raise DocumentRejected("signature does not match the document (not signed by AWS's key)") from None
    try:
        return parse_document(document)
    except ProtocolError as exc:
        raise DocumentRejected(str(exc)) from None
