"""A stand-in for AWS's instance identity signing key, for the fake IMDS (tests and the demo).

AWS signs each instance's identity document with a regional RSA key and publishes the matching
certificate; the controller verifies with that certificate. Here a throwaway RSA key plays AWS:
its certificate (``cert_path``) is what the demo's controller is configured with, its key never
leaves the fake IMDS's process. Shapes follow the real service: the document is pretty-printed
JSON with AWS's field names, ``/signature`` is base64 RSA-SHA256 over its exact bytes.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class IdentitySigner:
    key: rsa.RSAPrivateKey
    cert: x509.Certificate

    @classmethod
    def generate(cls, name: str = "fake-aws-instance-identity") -> IdentitySigner:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, name)])
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=365))
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    def write_certificate(self, path: Path) -> Path:
        """The public half, as an operator would save AWS's published certificate."""
        path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        return path

    def sign(self, document: str) -> str:
        sig = self.key.sign(document.encode(), padding.PKCS1v15(), hashes.SHA256())
        return base64.b64encode(sig).decode()

    @staticmethod
    def document(
        *,
        instance_id: str,
        instance_type: str,
        zone: str,
        private_ip: str,
        pending_time: float,
        region: str | None = None,
        account_id: str = "123456789012",
        image_id: str = "ami-0123456789abcdef0",
    ) -> str:
        body = {
            "accountId": account_id,
            "architecture": "x86_64",
            "availabilityZone": zone,
            "billingProducts": None,
            "devpayProductCodes": None,
            "marketplaceProductCodes": None,
            "imageId": image_id,
            "instanceId": instance_id,
            "instanceType": instance_type,
            "kernelId": None,
            "pendingTime": _iso(pending_time),
            "privateIp": private_ip,
            "ramdiskId": None,
            "region": region or zone[:-1],
            "version": "2017-09-30",
        }
        return json.dumps(body, indent=2)
