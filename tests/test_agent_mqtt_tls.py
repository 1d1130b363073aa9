"""MQTT security from config against the real mosquitto: TLS with client certificates (agents) and
TLS with username/password (controller). Wrong credentials never connect."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from agent.node.mqtt_session import MqttSession
from agent.node.outbox import Outbox
from fleetd.intake.mqtt import MqttIntake
from fleetd.intake.registry import NodeRegistry
from fleetd.protocol.messages import CheckpointSaved
from fleetd.shared.backoff import Backoff
from fleetd.shared.settings import MqttConfig
from tests.harness.ports import free_port

FLEET = "tls"
IID = "i-0000000000000c001"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server cert for 127.0.0.1, and one client cert, all EC P-256 (fast)."""
    d = tmp_path_factory.mktemp("pki")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=fleetd-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        cwd=d,
    )
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        _openssl(
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-subj",
            f"/CN={IID if name == 'client' else '127.0.0.1'}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=d,
        )
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
            "-out",
            f"{name}.crt",
            cwd=d,
        )
    return d


def tls_listener(port: int, pki: Path, extra: str) -> str:
    return (
        f"listener {port} 127.0.0.1\ncafile {pki}/ca.crt\ncertfile {pki}/server.crt\nkeyfile {pki}/server.key\n{extra}"
    )


async def test_agent_with_client_certificate(mosquitto_factory, pki: Path, tmp_path) -> None:
    port = free_port()
    mosquitto_factory(
        port=port,
        listener_block=tls_listener(port, pki, "require_certificate true\nuse_identity_as_username true"),
    ).start()
    url = f"mqtts://127.0.0.1:{port}"
    good = MqttConfig(url=url, ca_file=pki / "ca.crt", cert_file=pki / "client.crt", key_file=pki / "client.key")
    session = MqttSession(
        good,
        fleet=FLEET,
        instance_id=IID,
        outbox=Outbox(None),
        on_command=lambda m: asyncio.sleep(0),
        backoff=Backoff(0.1, 0.3),
    )
    # Same CA, no client certificate: the broker refuses the TLS handshake.
    no_cert = MqttSession(
        MqttConfig(url=url, ca_file=pki / "ca.crt"),
        fleet=FLEET,
        instance_id="i-0000000000000c002",
        outbox=Outbox(None),
        on_command=lambda m: asyncio.sleep(0),
        backoff=Backoff(0.1, 0.3),
    )
    registry = NodeRegistry()
    intake = MqttIntake(good, FLEET, registry, client_id="ctl-cert")
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(x.run()) for x in (intake, session, no_cert)]
        await asyncio.wait_for(intake.connected.wait(), 10)
        await asyncio.wait_for(session.connected.wait(), 10)
        await session.publish_event(CheckpointSaved(instance_id=IID, step=5, world_size=1))
        delivered = []
        for _ in range(250):
            delivered += registry.drain_training_events()
            if delivered:
                break
            await asyncio.sleep(0.02)
        assert not no_cert.connected.is_set() and no_cert.connects == 0
        for t in tasks:
            t.cancel()
    assert [e.message.step for e in delivered] == [5]


async def test_controller_with_username_password(mosquitto_factory, pki: Path, tmp_path) -> None:
    pwfile = tmp_path / "passwords"
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(pwfile), "fleetd", "s3cret"], check=True, capture_output=True)
    port = free_port()
    mosquitto_factory(
        port=port, listener_block=tls_listener(port, pki, f"allow_anonymous false\npassword_file {pwfile}")
    ).start()
    base = {"url": f"mqtts://127.0.0.1:{port}", "ca_file": pki / "ca.crt", "username": "fleetd"}
    ok = MqttIntake(MqttConfig(**base, password="s3cret"), FLEET, NodeRegistry(), client_id="ctl-ok")
    bad = MqttIntake(
        MqttConfig(**base, password="wrong"), FLEET, NodeRegistry(), client_id="ctl-bad", backoff_max_s=0.3
    )
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(ok.run()), tg.create_task(bad.run())]
        await asyncio.wait_for(ok.connected.wait(), 10)
        await asyncio.sleep(1.0)
        assert not bad.connected.is_set()  # refused, retried, and still running
        assert not tasks[1].done()
        for t in tasks:
            t.cancel()
