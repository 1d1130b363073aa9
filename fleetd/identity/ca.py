"""The fleet's certificate authority: who signs the broker's, the controller's and the nodes'
certificates. One small interface (``CertificateAuthority``) so the embedded default (a key on
the control host, ``LocalCa``) can be swapped for e.g. AWS Private CA without touching enrolment.

``LocalCa.init(directory)`` is what ``fleetd ca init`` and the demo run: it creates the CA key and
certificate once (kept), and (re)issues the broker's server certificate and the controller's
client certificate (CN=fleetd-controller), which the broker's ACL names.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fleetd.atomic_file import write_atomically

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes

CONTROLLER_CN = "fleetd-controller"  # deploy/mosquitto/acl: the only writer of commands
OBSERVER_CN = "fleetd-observer"  # deploy/mosquitto/acl: reads everything, writes nothing
BRIDGE_CN = "fleetd-bridge"  # deploy/mosquitto/acl + bridge.conf: the HA broker pair's bridge
BACKDATE = dt.timedelta(minutes=5)  # tolerate a node clock a little behind the CA's


class CertificateAuthority(Protocol):
    def ca_pem(self) -> bytes: ...

    async def issue_client(
        self, common_name: str, public_key: ec.EllipticCurvePublicKey, lifetime: dt.timedelta, now: dt.datetime
    ) -> x509.Certificate: ...


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


@dataclass(frozen=True)
class CaFiles:
    """What ``LocalCa.init`` leaves in its directory (the broker's and controller's file names)."""

    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.directory / "server.crt"

    @property
    def server_key(self) -> Path:
        return self.directory / "server.key"

    def client(self, cn: str) -> tuple[Path, Path]:
        return self.directory / f"{cn}.crt", self.directory / f"{cn}.key"


class LocalCa:
    """An EC P-256 CA whose key lives in a 0600 file on the control host."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.cert = cert
        self._key = key

    @classmethod
    def load(cls, files: CaFiles) -> LocalCa:
        cert = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
        key = serialization.load_pem_private_key(files.ca_key.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{files.ca_key}: not an EC key")
        return cls(cert, key)

    @classmethod
    def init(
        cls,
        directory: Path,
        *,
        server_names: tuple[str, ...] = ("localhost", "127.0.0.1"),
        clients: tuple[str, ...] = (CONTROLLER_CN,),
        lifetime: dt.timedelta = dt.timedelta(days=30),
        now: dt.datetime | None = None,
    ) -> LocalCa:
        """Create the CA once; (re)issue the server and the named client certificates."""
        now = now or dt.datetime.now(dt.UTC)
        files = CaFiles(directory)
        if files.ca_cert.exists() and files.ca_key.exists():
            ca = cls.load(files)
        else:
            key = ec.generate_private_key(ec.SECP256R1())
            cert = (
                x509.CertificateBuilder()
                .subject_name(_name("fleetd-ca"))
                .issuer_name(_name("fleetd-ca"))
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - BACKDATE)
                .not_valid_after(now + dt.timedelta(days=3650))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(
                    x509.KeyUsage(
                        digital_signature=True,
                        key_cert_sign=True,
                        crl_sign=True,
                        content_commitment=False,
                        key_encipherment=False,
                        data_encipherment=False,
                        key_agreement=False,
                        encipher_only=False,
                        decipher_only=False,
                    ),
                    critical=True,
                )
                .sign(key, hashes.SHA256())
            )
            write_atomically(files.ca_key, key_pem(key), mode=0o600)
            write_atomically(files.ca_cert, pem(cert), mode=0o644)
            ca = cls(cert, key)
        server_key = ec.generate_private_key(ec.SECP256R1())
        server = ca.sign(server_names[0], server_key.public_key(), lifetime, now, server_names=server_names)
        write_atomically(files.server_key, key_pem(server_key), mode=0o600)
        write_atomically(files.server_cert, pem(server), mode=0o644)
        for cn in clients:
            key = ec.generate_private_key(ec.SECP256R1())
            crt, kp = files.client(cn)
            write_atomically(kp, key_pem(key), mode=0o600)
            write_atomically(crt, pem(ca.sign(cn, key.public_key(), lifetime, now)), mode=0o644)
        return ca

    def ca_pem(self) -> bytes:
        return pem(self.cert)

    async def issue_client(
        self, common_name: str, public_key: ec.EllipticCurvePublicKey, lifetime: dt.timedelta, now: dt.datetime
    ) -> x509.Certificate:
        return self.sign(common_name, public_key, lifetime, now)

    def sign(
        self,
        common_name: str,
        public_key: CertificatePublicKeyTypes,
        lifetime: dt.timedelta,
        now: dt.datetime,
        *,
        server_names: tuple[str, ...] = (),
    ) -> x509.Certificate:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server_names else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self.cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + lifetime)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if server_names:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([_san(n) for n in server_names]), critical=False
            )
        return builder.sign(self._key, hashes.SHA256())


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)
