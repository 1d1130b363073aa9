"""A local MQTT broker for the demo: mosquitto, configured like deploy/mosquitto (TLS with
mandatory client certificates from the fleet CA, the certificate's CN as the username, the fleet
ACL), or, with ``--insecure`` only, a plaintext anonymous one (amqtt when mosquitto is missing).

fleetd's handlers never rely on the broker's topic filtering (amqtt is known to deliver stray
retained messages), so the insecure brokers are fine for debugging.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from fleetd.demo.procs import Child
from fleetd.demo.security import DemoPki
from fleetd.identity.acl import fleet_acl
from fleetd.localnet import free_port
from fleetd.localnet import wait_port_async as wait_port


def find_mosquitto() -> str | None:
    return shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.path.exists(p)), None
    )


def secure_listener(port: int, pki: DemoPki, acl: Path, host: str = "127.0.0.1") -> list[str]:
    """deploy/mosquitto/mosquitto.conf's security settings, on a local port."""
    f = pki.files
    return [
        "per_listener_settings false",
        "allow_anonymous false",
        f"acl_file {acl}",
        f"listener {port} {host}",
        f"cafile {f.ca_cert}",
        f"certfile {f.server_cert}",
        f"keyfile {f.server_key}",
        "require_certificate true",
        "use_identity_as_username true",
        "use_username_as_clientid true",
        "tls_version tlsv1.2",
    ]


def mosquitto_config(
    port: int, log: Path, host: str = "127.0.0.1", pki: DemoPki | None = None, acl: Path | None = None
) -> str:
    if pki is not None:
        assert acl is not None
        lines = secure_listener(port, pki, acl, host)
    else:
        lines = [f"listener {port} {host}", "allow_anonymous true"]
    lines += [
        "persistence false",
        f"log_dest file {log}",
        "log_type error",
        "log_type warning",
        "log_type notice",  # refused connections and handshakes are logged at notice level
    ]
    if os.geteuid() == 0:
        lines.append("user root")  # otherwise mosquitto drops to 'mosquitto' and cannot write the log
    return "\n".join(lines) + "\n"


def amqtt_config(port: int, host: str = "127.0.0.1") -> str:
    return (
        "listeners:\n  default:\n    type: tcp\n"
        f"    bind: {host}:{port}\n"
        "plugins:\n  amqtt.plugins.authentication.AnonymousAuthPlugin:\n    allow_anonymous: true\n"
    )


class BrokerUnavailable(Exception):
    """A secure broker was asked for and mosquitto is not installed."""


async def start_broker(
    workdir: Path, pki: DemoPki | None = None, controller_hosts: tuple[str, ...] = ()
) -> tuple[Child, str, str]:
    """Start a broker; returns (child, url, kind). With ``pki``: TLS + client certificates + ACL
    (mosquitto required); without: plaintext and anonymous (``--insecure``)."""
    port = free_port()
    exe = find_mosquitto()
    if pki is not None and exe is None:
        raise BrokerUnavailable(
            "the secure demo broker needs mosquitto (apt install mosquitto); "
            "or run with --insecure (plaintext, anonymous MQTT)"
        )
    if exe is not None:
        conf = workdir / "mosquitto.conf"
        acl = None
        if pki is not None:
            acl = workdir / "mosquitto.acl"
            acl.write_text(fleet_acl(controller_hosts))
        conf.write_text(mosquitto_config(port, workdir / "mosquitto.log", pki=pki, acl=acl))
        child = await Child.start("mosquitto", [exe, "-c", str(conf)], workdir / "mosquitto.out")
        kind = "mosquitto"
    else:
        conf = workdir / "amqtt.yaml"
        conf.write_text(amqtt_config(port))
        amqtt = shutil.which("amqtt") or "amqtt"
        child = await Child.start("amqtt", [amqtt, "-c", str(conf)], workdir / "amqtt.log")
        kind = "amqtt"
    await wait_port("127.0.0.1", port)
    return child, f"{'mqtts' if pki is not None else 'mqtt'}://127.0.0.1:{port}", kind
