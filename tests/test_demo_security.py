"""The demo's broker and identities, secure by default, against outside clients.

The stack is the demo's own pieces: ``DemoPki.create`` (the fleet CA via ``LocalCa.init``, the fake
AWS identity signer), ``start_broker`` (mosquitto configured like deploy/mosquitto), fleetd's
enrolment component built from the demo's fleetd.toml (EC2 = moto server, production adapter),
agents' enrolment from the demo's agent.toml over a fake IMDS that signs its identity document,
the agent's MqttSession and the controller's MqttIntake with the resulting certificates.

Must show: an anonymous client, a client with a self-signed certificate, and node A's valid
certificate publishing as node B are all refused by the broker.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import ssl
from pathlib import Path

import aiomqtt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent import config as agent_config
from agent.node.enrol import NodeEnrolment, mqtt_with_identity
from agent.node.imds import ImdsClient
from agent.node.mqtt_session import MqttSession
from agent.node.outbox import Outbox
from fleetd import config as fleetd_config
from fleetd.adapters.ec2 import TAG_FLEET
from fleetd.daemon import DaemonContext
from fleetd.demo import configs
from fleetd.demo.broker import mosquitto_config, start_broker
from fleetd.demo.security import DemoPki
from fleetd.identity.acl import FLEET_ACL
from fleetd.identity.ca import key_pem, pem
from fleetd.identity.server import enrolment_component
from fleetd.intake.mqtt import MqttIntake
from fleetd.intake.registry import NodeRegistry
from fleetd.protocol.messages import CheckpointCommand, CheckpointSaved, DrainCommand
from fleetd.protocol.topics import node_topic
from fleetd.shared.backoff import Backoff
from fleetd.shared.mqtt_options import tls_context
from tests.harness.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
FLEET = configs.DEMO_FLEET


def test_the_demo_broker_uses_the_deployed_acl_and_security_settings():
    assert FLEET_ACL == (ROOT / "deploy" / "mosquitto" / "acl").read_text()
    deployed = {
        ln.split()[0]: ln.split()[1:]
        for ln in (ROOT / "deploy" / "mosquitto" / "mosquitto.conf").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    }
    demo = mosquitto_config(1883, Path("/tmp/x.log"), pki=_pki_stub(), acl=Path("/tmp/acl"))
    settings = {ln.split()[0]: ln.split()[1:] for ln in demo.splitlines()}
    for key in (
        "allow_anonymous",
        "require_certificate",
        "use_identity_as_username",
        "use_username_as_clientid",
        "tls_version",
        "per_listener_settings",
    ):
        assert settings[key] == deployed[key], key


def _pki_stub():
    from fleetd.identity.ca import CaFiles

    class Stub:
        files = CaFiles(Path("/etc/fleetd/ca"))

    return Stub()


async def _launch(ec2, ami: str) -> dict:
    tags = [{"ResourceType": "instance", "Tags": [{"Key": TAG_FLEET, "Value": FLEET}]}]
    return (
        await ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType="g5.xlarge", TagSpecifications=tags)
    )["Instances"][0]


def _self_signed(directory: Path, cn: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .sign(key, hashes.SHA256())
    )
    crt, kp = directory / f"self-{cn}.crt", directory / f"self-{cn}.key"
    crt.write_bytes(pem(cert))
    kp.write_bytes(key_pem(key))
    return crt, kp


def _ctx(ca: Path, cert: tuple[Path, Path] | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    return ctx


async def _refused(host: str, port: int, ctx: ssl.SSLContext | None, topic: str) -> bool:
    try:
        async with aiomqtt.Client(host, port, identifier="intruder", tls_context=ctx, timeout=2) as c:
            await c.publish(topic, b"intruder", qos=1, timeout=2)
    except aiomqtt.MqttError:
        return True
    return False


async def test_only_enrolled_nodes_speak_and_only_for_themselves(tmp_path, aio_session, aws_client_kwargs):
    pki = await asyncio.to_thread(DemoPki.create, tmp_path)
    broker, url, kind = await start_broker(tmp_path, pki)
    assert kind == "mosquitto" and url.startswith("mqtts://")
    host, port = "127.0.0.1", int(url.rsplit(":", 1)[1])
    ep = configs.DemoEndpoints(
        aws_url=aws_client_kwargs["endpoint_url"],
        s3_url=aws_client_kwargs["endpoint_url"],
        mqtt_url=url,
        rdzv_port=free_port(),
        pki=pki,
        enrol_port=free_port(),
    )
    cfg = fleetd_config.load(configs.fleetd_toml(tmp_path, ep, 2, 5.0, 10.0, "ami-demo"))
    ctx = DaemonContext(cfg)
    registry = NodeRegistry()
    intake = MqttIntake(cfg.mqtt, FLEET, registry, client_id="fleetd-demo")
    received: dict[str, list] = {}
    sessions: dict[str, MqttSession] = {}
    try:
        async with aio_session.create_client("ec2", **aws_client_kwargs) as ec2, asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(enrolment_component(cfg)(ctx)), tg.create_task(intake.run())]
            ami = (await ec2.describe_images(Owners=["amazon"]))["Images"][0]["ImageId"]
            a, b = [await _launch(ec2, ami) for _ in range(2)]
            imdses = []
            for inst in (a, b):
                from agent.doubles.fake_imds import FakeImds

                iid = inst["InstanceId"]
                imds = FakeImds(
                    instance_id=iid,
                    zone=inst["Placement"]["AvailabilityZone"],
                    signer=pki.signer,
                    pending_time=inst["LaunchTime"].timestamp(),
                )
                await imds.start()
                imdses.append(imds)
                acfg = agent_config.load(configs.agent_toml(tmp_path, ep, 3, iid, "127.0.0.10", imds.url, steps=10))
                async with ImdsClient(acfg.node.imds_url) as client:
                    enrolment = NodeEnrolment(acfg.node.enrol_url, client, iid, acfg.node.state_dir / "identity")
                    await asyncio.wait_for(enrolment.ensure(), 30)
                received[iid] = []
                sessions[iid] = MqttSession(
                    mqtt_with_identity(acfg.mqtt, enrolment.files),
                    fleet=FLEET,
                    instance_id=iid,
                    outbox=Outbox(None),
                    on_command=lambda m, iid=iid: _append(received[iid], m),
                    status_fields={"node_addr": f"127.0.0.{10 + len(sessions)}"},
                    backoff=Backoff(0.1, 0.5),
                )
                tasks.append(tg.create_task(sessions[iid].run()))
            A, B = a["InstanceId"], b["InstanceId"]
            await asyncio.wait_for(intake.connected.wait(), 15)
            for s in sessions.values():
                await asyncio.wait_for(s.connected.wait(), 15)
            await _until(
                lambda: all(registry.record(i) and registry.record(i).status for i in (A, B)),
                "both nodes' status reached the controller",
            )

            ca = pki.files.ca_cert
            node_a = (sessions[A].cfg.cert_file, sessions[A].cfg.key_file)
            events_b = node_topic(FLEET, B, "events")
            log_before = len((tmp_path / "mosquitto.log").read_text())
            # 1. anonymous: TLS with the right CA but no client certificate; and plain TCP.
            assert await _refused(host, port, _ctx(ca, None), events_b)
            assert await _refused(host, port, None, events_b)
            # 2. a self-signed certificate claiming to be node A (or the controller).
            assert await _refused(host, port, _ctx(ca, _self_signed(tmp_path, A)), events_b)
            assert await _refused(host, port, _ctx(ca, _self_signed(tmp_path, "fleetd-controller")), events_b)
            log = (tmp_path / "mosquitto.log").read_text()[log_before:]
            assert "peer did not return a certificate" in log and "certificate verify failed" in log, log

            # 3. node A's genuine certificate, publishing as node B and commanding B. It even asks
            # for B's client id: the broker names the session after the certificate instead
            # (use_username_as_clientid), so B's own session is not taken over.
            async with aiomqtt.Client(
                host, port, identifier=f"fleet-agent-{FLEET}-{B}", tls_context=_ctx(ca, node_a), timeout=5
            ) as intruder:
                spoof = CheckpointSaved(instance_id=B, step=999, world_size=1)
                await intruder.publish(events_b, spoof.to_json(), qos=1)
                await intruder.publish(node_topic(FLEET, B, "status"), b"offline", qos=1, retain=True)
                await intruder.publish(
                    node_topic(FLEET, B, "commands"), DrainCommand(instance_id=B, reason="forged").to_json(), qos=1
                )
                # Same connection, after the forgeries: A's own event is accepted, so had the
                # forgeries been accepted they would have reached the controller before it.
                own = CheckpointSaved(instance_id=A, step=7, world_size=1)
                await intruder.publish(node_topic(FLEET, A, "events"), own.to_json(), qos=1)
            delivered = []
            await _until(
                lambda: (
                    delivered.extend(registry.drain_training_events())
                    or any(e.message.instance_id == A for e in delivered)
                ),
                "A's own event",
            )
            assert [e.message.step for e in delivered] == [7], delivered
            # The controller, and only it, commands B.
            await intake.send_command(CheckpointCommand(instance_id=B, reason="genuine"))
            await _until(lambda: received[B], "B received the controller's command")
            assert [m.kind for m in received[B]] == ["checkpoint"], received[B]
            assert sessions[B].connects == 1  # never knocked off by the intruder
            assert registry.record(B).status.state != "offline"  # the forged retained "offline" never landed
            # The observer identity (the demo's view) reads but cannot command.
            obs = pki.observer(url)
            async with aiomqtt.Client(host, port, identifier="view", tls_context=tls_context(obs), timeout=5) as view:
                await view.publish(
                    node_topic(FLEET, B, "commands"),
                    DrainCommand(instance_id=B, reason="from the view").to_json(),
                    qos=1,
                )
            await intake.send_command(CheckpointCommand(instance_id=B, reason="marker"))
            await _until(lambda: len(received[B]) >= 2, "B received the marker command")
            assert [m.reason for m in received[B]] == ["genuine", "marker"], received[B]
            for t in tasks:
                t.cancel()
            for imds in imdses:
                await imds.stop()
    finally:
        await broker.stop(timeout=5.0)


async def _append(box: list, m) -> None:
    box.append(m)


async def _until(cond, what: str, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        await asyncio.sleep(0.05)


# ------------------------------------------------------------------ probing a running `fleetd demo`
def _wait_for(cond, what: str, timeout: float):
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


class _V5:
    """A paho MQTT v5 client: the broker answers every QoS 1 PUBLISH and SUBSCRIBE with a reason
    code, so a refusal is read from the broker itself, not inferred from a silence."""

    def __init__(self, host: str, port: int, ctx: ssl.SSLContext, client_id: str) -> None:
        import threading

        import paho.mqtt.client as paho

        self.acks: dict[int, object] = {}
        self._cv = threading.Condition()
        self.c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
        self.c.tls_set_context(ctx)
        self.c.on_publish = lambda _c, _u, mid, rc, _p: self._ack(mid, rc)
        self.c.on_subscribe = lambda _c, _u, mid, rcs, _p: self._ack(mid, rcs)
        self.c.connect(host, port, keepalive=30)
        self.c.loop_start()

    def _ack(self, mid: int, rc: object) -> None:
        with self._cv:
            self.acks[mid] = rc
            self._cv.notify_all()

    def _wait(self, mid: int) -> object:
        with self._cv:
            assert self._cv.wait_for(lambda: mid in self.acks, timeout=10), f"no ack for mid {mid}"
            return self.acks[mid]

    def publish(self, topic: str, payload: bytes) -> str:
        info = self.c.publish(topic, payload, qos=1)
        return str(self._wait(info.mid))

    def subscribe(self, topic: str) -> str:
        _, mid = self.c.subscribe(topic, qos=1)
        return str(self._wait(mid)[0])  # type: ignore[index]

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def probe_running_demo(workdir: Path, timeout: float = 240.0) -> dict[str, object]:
    """Run outside clients against a running `fleetd demo`'s broker (tests/test_demo.py calls it
    while the demo runs). Nothing it sends can disturb the demo: every payload it gets through
    is one the controller rejects as malformed, and no client id it uses is one the demo uses."""
    from fleetd.identity.ca import CaFiles, LocalCa

    conf = _wait_for(
        lambda: (workdir / "mosquitto.conf").exists() and (workdir / "mosquitto.conf").read_text(),
        "the demo's broker config",
        timeout,
    )
    port = int(re.search(r"^listener (\d+) 127\.0\.0\.1$", conf, re.M).group(1))  # type: ignore[union-attr]
    enrolled = _wait_for(
        lambda: sorted(p.parent.parent.name for p in (workdir / "nodes").glob("*/identity/node.crt")),
        "an enrolled node",
        timeout,
    )
    victim = enrolled[0]
    files = CaFiles(workdir / "pki")
    ca = files.ca_cert
    host = "127.0.0.1"
    out: dict[str, object] = {"victim": victim}

    async def handshakes() -> None:
        topic = node_topic(FLEET, victim, "events")
        out["anonymous_refused"] = await _refused(host, port, _ctx(ca, None), topic)
        out["plaintext_refused"] = await _refused(host, port, None, topic)
        out["self_signed_refused"] = await _refused(host, port, _ctx(ca, _self_signed(workdir, victim)), topic)

    asyncio.run(handshakes())
    # A genuine certificate from the fleet CA for another node A (as enrolment would issue it; a
    # fresh id, so no client of the demo is taken over), publishing as the demo's node B.
    node_a = "i-0aaaaaaaaaaaaaaaa"
    key = ec.generate_private_key(ec.SECP256R1())
    cert = LocalCa.load(files).sign(node_a, key.public_key(), dt.timedelta(minutes=10), dt.datetime.now(dt.UTC))
    crt, kp = workdir / "probe-a.crt", workdir / "probe-a.key"
    crt.write_bytes(pem(cert))
    kp.write_bytes(key_pem(key))
    a = _V5(host, port, _ctx(ca, (crt, kp)), "ignored-the-broker-uses-the-cn")
    try:
        junk = b"probe: not a fleetd message"
        out["as_b_events"] = a.publish(node_topic(FLEET, victim, "events"), junk)
        out["as_b_status"] = a.publish(node_topic(FLEET, victim, "status"), junk)
        out["command_to_b"] = a.publish(node_topic(FLEET, victim, "commands"), junk)
        # (Reading B's commands: mosquitto grants the SUBSCRIBE and filters each delivery by the read
        # ACL; the test above and tests/test_deploy_mosquitto.py show nothing is delivered.)
        out["own_telemetry"] = a.publish(node_topic(FLEET, node_a, "telemetry"), junk)  # the control: allowed
        out["own_commands"] = a.subscribe(node_topic(FLEET, node_a, "commands"))
    finally:
        a.close()
    return out


def assert_demo_broker_refused(out: dict[str, object]) -> None:
    assert out["anonymous_refused"] and out["plaintext_refused"] and out["self_signed_refused"], out
    for k in ("as_b_events", "as_b_status", "command_to_b"):
        assert out[k] == "Not authorized", (k, out)
    # Accepted (v5 says "no matching subscribers" when no controller listens, as in the probe's own test).
    assert out["own_telemetry"] in ("Success", "No matching subscribers"), out
    assert out["own_commands"] == "Granted QoS 1", out


async def test_the_demo_probe_reads_refusals_from_the_broker(tmp_path):
    """The probe that tests/test_demo.py runs during a demo, against the demo's broker alone."""
    pki = await asyncio.to_thread(DemoPki.create, tmp_path)
    broker, _, _ = await start_broker(tmp_path, pki)
    try:
        node_b = tmp_path / "nodes" / "i-0bbbbbbbbbbbbbbbb" / "identity"
        node_b.mkdir(parents=True)
        (node_b / "node.crt").write_text("enrolled")
        out = await asyncio.to_thread(probe_running_demo, tmp_path, 30.0)
        assert_demo_broker_refused(out)
    finally:
        await broker.stop(timeout=5.0)
