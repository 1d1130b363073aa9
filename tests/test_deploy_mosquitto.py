"""The broker configuration from deploy/mosquitto on a real mosquitto: TLS with client certificates
and the per-agent ACL. Certificates are made at test time with `cryptography` (a throwaway CA)."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import re
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import aiomqtt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fleetd.protocol import Notice, Status, node_topic
from tests.harness.mosquitto import Mosquitto

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "mosquitto"
PROD_DIR = "/etc/mosquitto/fleetd/"
FLEET = "prod"
AGENT_A, AGENT_B = "i-0aaaaaaaaaaaaaaaa", "i-0bbbbbbbbbbbbbbbb"
CONTROLLER = "fleetd-controller"


# ------------------------------------------------------------------ a throwaway PKI
@dataclass
class Pem:
    cert: Path
    key: Path


class ThrowawayCA:
    def __init__(self, directory: Path, name: str) -> None:
        self.dir = directory
        self.name = name
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (
            self._builder(subject, self.key.public_key())
            .issuer_name(subject)
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
            .sign(self.key, hashes.SHA256())
        )
        self.cert_path = directory / f"{name}.crt"
        self.cert_path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    @staticmethod
    def _builder(subject: x509.Name, public_key) -> x509.CertificateBuilder:
        now = dt.datetime.now(dt.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=1))
        )

    def issue(self, common_name: str, *, server: bool = False) -> Pem:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            self._builder(subject, key.public_key())
            .issuer_name(self.cert.subject)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        cert = builder.sign(self.key, hashes.SHA256())
        stem = self.dir / f"{self.name}-{common_name}"
        pem = Pem(stem.with_suffix(".crt"), stem.with_suffix(".key"))
        pem.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pem.key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return pem


# ------------------------------------------------------------------ the broker, as deployed
def deployed_config(directory: Path, port: int, *, persistence_here: bool = True) -> str:
    """deploy/mosquitto/mosquitto.conf with only the machine-specific parts changed: the files live
    in ``directory`` instead of /etc/mosquitto/fleetd, the port is free, persistence goes to tmp
    (``persistence_here``: the including file does not say where)."""
    text = (DEPLOY / "mosquitto.conf").read_text()
    text = text.replace(PROD_DIR, f"{directory}/")
    text = re.sub(r"^listener 8883$", f"listener {port} 127.0.0.1", text, flags=re.M)
    # Persistence goes where the including file says (the stock one names /var/lib/mosquitto).
    if persistence_here:
        text += f"\npersistence_location {directory}/\n"
    assert f"listener {port} 127.0.0.1" in text
    return text


@dataclass
class Pki:
    ca: ThrowawayCA
    controller: Pem
    agent_a: Pem
    agent_b: Pem
    rogue_agent_a: Pem  # CN=AGENT_A, but signed by a CA the broker does not trust


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca = ThrowawayCA(directory, "fleet-ca")
    server = ca.issue("localhost", server=True)
    # The names the deployed config expects.
    (directory / "ca.crt").write_bytes(ca.cert_path.read_bytes())
    (directory / "server.crt").write_bytes(server.cert.read_bytes())
    (directory / "server.key").write_bytes(server.key.read_bytes())
    (directory / "acl").write_text((DEPLOY / "acl").read_text())
    rogue = ThrowawayCA(directory, "rogue-ca")
    return Pki(ca, ca.issue(CONTROLLER), ca.issue(AGENT_A), ca.issue(AGENT_B), rogue.issue(AGENT_A))


@pytest.fixture(scope="module")
def broker(pki: Pki):
    from tests.harness.ports import free_port

    port = free_port()
    b = Mosquitto(port=port, listener_block=deployed_config(pki.ca.dir, port))
    b.start()
    yield b
    b.close()


def tls(pki: Pki, client: Pem | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca.cert_path))
    if client is not None:
        ctx.load_cert_chain(str(client.cert), str(client.key))
    return ctx


def client(broker: Mosquitto, ctx: ssl.SSLContext | None, ident: str) -> aiomqtt.Client:
    return aiomqtt.Client(broker.host, broker.port, identifier=ident, tls_context=ctx, timeout=5)


async def next_message(c: aiomqtt.Client, timeout: float = 10.0) -> aiomqtt.Message:
    async def first() -> aiomqtt.Message:
        async for m in c.messages:
            return m
        raise AssertionError("subscription ended")

    return await asyncio.wait_for(first(), timeout)


# ------------------------------------------------------------------ tests
async def test_agent_cannot_publish_under_another_instance_id(broker, pki):
    own = node_topic(FLEET, AGENT_A, "events")
    foreign = node_topic(FLEET, AGENT_B, "events")
    async with client(broker, tls(pki, pki.controller), "controller") as controller:
        await controller.subscribe(f"fleetd/{FLEET}/nodes/+/#", qos=1)
        # Identifiers prove nothing: agent A even pretends to be B at the MQTT level.
        async with client(broker, tls(pki, pki.agent_a), AGENT_B) as agent_a:
            spoofed = Notice(instance_id=AGENT_B, action="terminate", action_time=dt.datetime.now(dt.UTC))
            await agent_a.publish(foreign, spoofed.to_json(), qos=1)
            await agent_a.publish(node_topic(FLEET, AGENT_B, "status"), b"offline", qos=1, retain=True)
            genuine = Notice(instance_id=AGENT_A, action="terminate", action_time=dt.datetime.now(dt.UTC))
            await agent_a.publish(own, genuine.to_json(), qos=1)
            # One connection's messages arrive in order: if the spoofed ones had been accepted they
            # would come before the genuine one.
            received = await next_message(controller)
            assert str(received.topic) == own and received.payload == genuine.to_json()
            with pytest.raises(TimeoutError):
                await next_message(controller, timeout=1.0)


async def test_agent_receives_only_its_own_commands_and_only_the_controller_commands(broker, pki):
    mine, theirs = node_topic(FLEET, AGENT_A, "commands"), node_topic(FLEET, AGENT_B, "commands")
    async with (
        client(broker, tls(pki, pki.agent_a), AGENT_A) as agent_a,
        client(broker, tls(pki, pki.agent_b), AGENT_B) as agent_b,
        client(broker, tls(pki, pki.controller), "controller") as controller,
    ):
        await agent_a.subscribe(f"fleetd/{FLEET}/nodes/+/commands", qos=1)
        await agent_b.publish(mine, b"forged command from another node", qos=1)
        await controller.publish(theirs, b"for B", qos=1)
        await controller.publish(mine, b"for A", qos=1)
        received = await next_message(agent_a)
        assert (str(received.topic), received.payload) == (mine, b"for A")
        with pytest.raises(TimeoutError):
            await next_message(agent_a, timeout=1.0)


async def test_agent_status_and_last_will_are_accepted_under_its_own_id(broker, pki):
    topic = node_topic(FLEET, AGENT_A, "status")
    offline = Status(instance_id=AGENT_A, state="offline").to_json()
    will = aiomqtt.Will(topic, offline, qos=1, retain=True)
    agent = aiomqtt.Client(
        broker.host, broker.port, identifier=AGENT_A, tls_context=tls(pki, pki.agent_a), will=will, timeout=5
    )
    async with client(broker, tls(pki, pki.controller), "controller") as controller:
        await controller.subscribe(topic, qos=1)
        async with agent:
            await agent.publish(topic, Status(instance_id=AGENT_A, state="ready").to_json(), qos=1, retain=True)
            assert b'"ready"' in (await next_message(controller)).payload
            # Drop the connection without DISCONNECT: the broker publishes the will.
            agent._client.socket().shutdown(socket.SHUT_RDWR)
            assert (await next_message(controller)).payload == offline
        await controller.publish(topic, b"", qos=1, retain=True)  # clear the retained status


@pytest.mark.parametrize(
    "who,broker_says",
    [
        ("no client certificate", "peer did not return a certificate"),
        ("certificate from another CA", "certificate verify failed"),
        ("plain TCP", "wrong version number"),
    ],
)
async def test_connection_without_a_valid_certificate_is_refused(broker, pki, who, broker_says):
    ctx = {
        "no client certificate": lambda: tls(pki, None),
        "certificate from another CA": lambda: tls(pki, pki.rogue_agent_a),
        "plain TCP": lambda: None,
    }[who]()
    log_before = len(broker.log_text())
    # The broker drops the connection during the handshake; aiomqtt then reports the missing
    # CONNACK at its timeout, so a short one keeps this fast.
    refused = aiomqtt.Client(broker.host, broker.port, identifier=AGENT_A, tls_context=ctx, timeout=2)
    with pytest.raises(aiomqtt.MqttError):
        async with refused as c:
            await c.publish(node_topic(FLEET, AGENT_A, "events"), b"x", qos=1, timeout=2)
    assert broker_says in broker.log_text()[log_before:]


def test_deployed_config_has_no_anonymous_or_plaintext_listener():
    lines = [
        ln.split()
        for ln in (DEPLOY / "mosquitto.conf").read_text().splitlines()
        if ln.strip() and not ln.lstrip().startswith("#")
    ]
    settings = {ln[0]: ln[1:] for ln in lines}
    assert [ln for ln in lines if ln[0] == "listener"] == [["listener", "8883"]]
    assert settings["allow_anonymous"] == ["false"]
    assert settings["require_certificate"] == ["true"]
    assert settings["use_identity_as_username"] == ["true"]
    acl = (DEPLOY / "acl").read_text()
    assert "%c" not in "".join(ln for ln in acl.splitlines() if not ln.startswith("#"))


async def test_only_the_controller_writes_the_rendezvous_endpoint_and_every_node_reads_it(broker, pki):
    """HA: the leader publishes its store retained on fleetd/<fleet>/rendezvous and agents follow
    it, so the ACL must let them read it and must not let a node write it."""
    topic = f"fleetd/{FLEET}/rendezvous"
    async with client(broker, tls(pki, pki.controller), "controller") as controller:
        await controller.subscribe(topic, qos=1)
        async with client(broker, tls(pki, pki.agent_b), AGENT_B) as agent_b:
            await agent_b.publish(topic, b"forged endpoint", qos=1, retain=True)
        await controller.publish(topic, b"leader's endpoint", qos=1, retain=True)
        received = await next_message(controller)
        assert received.payload == b"leader's endpoint", "the node's forged endpoint was accepted"
    async with client(broker, tls(pki, pki.agent_a), AGENT_A) as agent_a:
        await agent_a.subscribe(topic, qos=1)
        received = await next_message(agent_a)
        assert received.payload == b"leader's endpoint" and received.retain
        async with client(broker, tls(pki, pki.controller), "controller") as controller:
            await controller.publish(topic, b"", qos=1, retain=True)  # clear it for the other tests


async def test_the_deployed_bridge_pair_carries_fleet_traffic_both_ways(pki, tmp_path):
    """deploy/mosquitto/bridge.conf on a deployed broker (A) bridging to another deployed broker
    (B), over TLS with the fleetd-bridge certificate and the deployed ACL on both: a node on A and
    the controller on B talk as if they shared one broker, retained endpoint included."""
    from tests.harness.ports import free_port

    bridge = pki.ca.issue("fleetd-bridge")
    (pki.ca.dir / "bridge.crt").write_bytes(bridge.cert.read_bytes())
    (pki.ca.dir / "bridge.key").write_bytes(bridge.key.read_bytes())
    port_b, port_a = free_port(), free_port()
    b = Mosquitto(port=port_b, listener_block=deployed_config(pki.ca.dir, port_b))
    conf = (DEPLOY / "bridge.conf").read_text().replace(PROD_DIR, f"{pki.ca.dir}/")
    conf = re.sub(r"^address .*$", f"address 127.0.0.1:{port_b}", conf, flags=re.M)
    a = Mosquitto(port=port_a, listener_block=deployed_config(pki.ca.dir, port_a) + "\n" + conf)
    b.start()
    a.start()
    try:
        topic = f"fleetd/{FLEET}/rendezvous"
        async with client(b, tls(pki, pki.controller), "controller") as controller:
            await controller.subscribe(f"fleetd/{FLEET}/nodes/+/events", qos=1)
            await controller.publish(topic, b"leader's endpoint", qos=1, retain=True)
            async with client(a, tls(pki, pki.agent_a), AGENT_A) as agent:
                await agent.subscribe(node_topic(FLEET, AGENT_A, "commands"), qos=1)
                await agent.subscribe(topic, qos=1)
                got = b""
                for _ in range(60):  # until the bridge is up and has B's retained endpoint
                    try:
                        got = (await next_message(agent, timeout=0.5)).payload
                        break
                    except TimeoutError:
                        await agent.unsubscribe(topic)
                        await agent.subscribe(topic, qos=1)
                assert got == b"leader's endpoint", a.log_text()[-2000:]
                await agent.publish(node_topic(FLEET, AGENT_A, "events"), b"event from A", qos=1)
                assert (await next_message(controller)).payload == b"event from A"
                await controller.publish(node_topic(FLEET, AGENT_A, "commands"), b"command via B", qos=1)
                assert (await next_message(agent)).payload == b"command via B"
            await controller.publish(topic, b"", qos=1, retain=True)
    finally:
        a.close()
        b.close()
