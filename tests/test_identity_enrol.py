"""Node enrolment end to end over real HTTP: the agent's NodeEnrolment reads the fake IMDS's signed
identity document and asks fleetd's enrolment endpoint, which checks it against EC2 (moto server,
through the production EC2 adapter) and signs with the embedded CA.

Must show: a forged or replayed identity document, or an instance not in the fleet, gets no
certificate; the genuine node gets one (CN = its instance id) and renews it with its own key."""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent.doubles.fake_iid import IdentitySigner
from agent.doubles.fake_imds import FakeImds
from agent.node.enrol import EnrolFailed, NodeEnrolment, make_csr
from agent.node.imds import ImdsClient
from fleetd.adapters.ec2 import TAG_FLEET, AioEc2
from fleetd.identity.bindings import BindingStore
from fleetd.identity.ca import LocalCa
from fleetd.identity.rules import EnrolSettings
from fleetd.identity.server import EnrolmentServer
from fleetd.identity.service import Enrolment
from fleetd.protocol.enrol import ENROL_PATH, EnrolRequest
from tests.harness.ca_cli import ca_init

FLEET = "prod"
LIFETIME_S = 600.0


class Clock:
    def __init__(self) -> None:
        import time

        self.offset = 0.0
        self._time = time.time

    def __call__(self) -> float:
        return self._time() + self.offset


@pytest.fixture
async def ec2(aio_session, aws_client_kwargs):
    async with aio_session.create_client("ec2", **aws_client_kwargs) as client:
        yield client


async def _launch(ec2, *, tagged: bool = True) -> dict:
    ami = (await ec2.describe_images(Owners=["amazon"]))["Images"][0]["ImageId"]
    kwargs = {}
    if tagged:
        kwargs["TagSpecifications"] = [{"ResourceType": "instance", "Tags": [{"Key": TAG_FLEET, "Value": FLEET}]}]
    return (await ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType="g5.xlarge", **kwargs))[
        "Instances"
    ][0]


@pytest.fixture
async def stack(ec2, tmp_path):
    aws = IdentitySigner.generate()
    ca = LocalCa.init(tmp_path / "ca")
    clock = Clock()
    lookup = AioEc2(ec2, fleet=FLEET, job="train").fleet_instance_state
    service = Enrolment(
        ca,
        aws.cert.public_key(),
        lookup,  # type: ignore[arg-type]
        EnrolSettings(region="us-east-1", cert_lifetime_s=LIFETIME_S, max_document_age_s=900.0),
        BindingStore(tmp_path / "state" / "enrolments.json"),
        clock=clock,
    )
    server = EnrolmentServer(service, "127.0.0.1", 0)
    port = await server.start()
    yield {
        "aws": aws,
        "ca": ca,
        "clock": clock,
        "service": service,
        "url": f"http://127.0.0.1:{port}",
        "tmp": tmp_path,
        "ec2": ec2,
    }
    await server.stop()


def _node(stack, inst: dict, *, signer: IdentitySigner | None = None) -> FakeImds:
    """The instance's metadata service (``async with`` starts it)."""
    return FakeImds(
        instance_id=inst["InstanceId"],
        instance_type=inst["InstanceType"],
        zone=inst["Placement"]["AvailabilityZone"],
        signer=signer or stack["aws"],
        pending_time=inst["LaunchTime"].timestamp(),
    )


async def _enrol(stack, imds: FakeImds, directory_name: str = "node") -> NodeEnrolment:
    async with ImdsClient(imds.url) as client:
        node = NodeEnrolment(stack["url"], client, imds.instance_id, stack["tmp"] / directory_name)
        await node.enrol_once()
        return node


async def test_a_fleet_instance_gets_a_short_lived_certificate_named_after_it_and_renews_it(stack, ec2):
    inst = await _launch(ec2)
    async with _node(stack, inst) as imds:
        node = await _enrol(stack, imds)
        cert = x509.load_pem_x509_certificate(node.files.cert.read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == inst["InstanceId"]
        cert.verify_directly_issued_by(stack["ca"].cert)
        life = (cert.not_valid_after_utc - cert.not_valid_before_utc).total_seconds()
        assert life <= LIFETIME_S + 600  # short-lived (plus the notBefore backdate)
        assert stat.S_IMODE(node.files.key.stat().st_mode) == 0o600
        assert 0 < node.renew_in_s(node.received_at) <= LIFETIME_S * 2 / 3 + 1
        # Renewal: the same node (same key), long after its document stopped being fresh.
        stack["clock"].offset = 3 * 3600.0
        first_key = node.files.key.read_bytes()
        async with ImdsClient(imds.url) as client:
            again = NodeEnrolment(stack["url"], client, imds.instance_id, node.files.directory)
            await again.enrol_once()
        assert node.files.key.read_bytes() == first_key
        assert stack["service"].issued == 2


async def test_forged_documents_get_no_certificate(stack, ec2):
    inst = await _launch(ec2)
    rogue = IdentitySigner.generate("not-aws")
    async with _node(stack, inst, signer=rogue) as imds:
        with pytest.raises(EnrolFailed, match="signature does not match"):
            await _enrol(stack, imds)
    # A genuine signature over a document edited to name another (fleet) instance.
    victim = await _launch(ec2)
    aws: IdentitySigner = stack["aws"]
    genuine = IdentitySigner.document(
        instance_id=inst["InstanceId"],
        instance_type="g5.xlarge",
        zone="us-east-1a",
        private_ip="10.0.0.1",
        pending_time=inst["LaunchTime"].timestamp(),
    )
    edited = genuine.replace(inst["InstanceId"], victim["InstanceId"])
    status, body = await _post(
        stack,
        EnrolRequest(
            document=edited,
            signature=aws.sign(genuine),
            csr_pem=make_csr(ec.generate_private_key(ec.SECP256R1()), victim["InstanceId"]),
        ),
    )
    assert status == 403 and "signature does not match" in body["reason"]
    assert stack["service"].issued == 0


async def test_a_replayed_document_gets_no_certificate(stack, ec2):
    inst = await _launch(ec2)
    async with _node(stack, inst) as imds:
        await _enrol(stack, imds)  # the real node enrols first
        async with ImdsClient(imds.url) as client:  # an attacker who once read the document
            from fleetd.protocol.enrol import DOCUMENT_PATH, SIGNATURE_PATH

            doc, sig = await client.get_text(DOCUMENT_PATH), await client.get_text(SIGNATURE_PATH)
    attacker_csr = make_csr(ec.generate_private_key(ec.SECP256R1()), inst["InstanceId"])
    status, body = await _post(stack, EnrolRequest(document=doc, signature=sig, csr_pem=attacker_csr))
    assert status == 403 and "live certificate was already issued" in body["reason"]
    # Later, once the node's certificate has run out, the document is too old to be a first enrolment.
    stack["clock"].offset = LIFETIME_S + 3600.0
    status, body = await _post(stack, EnrolRequest(document=doc, signature=sig, csr_pem=attacker_csr))
    assert status == 403 and "replayed document earns nothing" in body["reason"]
    assert stack["service"].issued == 1


async def test_an_instance_not_in_the_fleet_or_not_running_gets_no_certificate(stack, ec2):
    untagged = await _launch(ec2, tagged=False)
    async with _node(stack, untagged) as imds:
        with pytest.raises(EnrolFailed, match="not an instance of this fleet"):
            await _enrol(stack, imds, "untagged")
    gone = await _launch(ec2)
    await ec2.terminate_instances(InstanceIds=[gone["InstanceId"]])
    async with _node(stack, gone) as imds:
        with pytest.raises(EnrolFailed, match="not running"):
            await _enrol(stack, imds, "gone")
    # A document for an instance id EC2 never heard of (signed by AWS's key: e.g. another account's).
    fake = dict(untagged, InstanceId="i-0fffffffffffffff0")
    async with _node(stack, fake) as imds:
        with pytest.raises(EnrolFailed, match="not an instance of this fleet"):
            await _enrol(stack, imds, "unknown")
    assert stack["service"].issued == 0 and stack["service"].refused == 3


async def test_bad_requests_are_answered_400_and_the_endpoint_keeps_serving(stack, ec2):
    async with aiohttp.ClientSession() as http:
        for body in (b"", b"not json", json.dumps({"document": 1}).encode(), b"{" * 20000):
            async with http.post(stack["url"] + ENROL_PATH, data=body) as resp:
                assert resp.status in (400, 413), (body[:20], resp.status)
    inst = await _launch(ec2)
    async with _node(stack, inst) as imds:
        await _enrol(stack, imds)
    assert stack["service"].issued == 1


async def _post(stack, req: EnrolRequest) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(stack["url"] + ENROL_PATH, data=req.to_json()) as resp:
            return resp.status, json.loads(await resp.read())


def test_ca_init_command_makes_the_files_the_broker_and_controller_use(tmp_path):

    d = tmp_path / "ca"
    out = ca_init(d, broker_names=("mqtt.fleet.internal", "10.0.1.10"))
    assert out.returncode == 0, out.stderr
    ca_key = (d / "ca.key").read_bytes()
    for name in ("ca.crt", "server.crt", "server.key", "fleetd-controller.crt", "fleetd-controller.key"):
        assert (d / name).exists(), name
    assert stat.S_IMODE((d / "ca.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((d / "fleetd-controller.key").stat().st_mode) == 0o600
    ca = x509.load_pem_x509_certificate((d / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((d / "server.crt").read_bytes())
    server.verify_directly_issued_by(ca)
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "mqtt.fleet.internal" in sans.get_values_for_type(x509.DNSName)
    # Run again (renewing the broker's and controller's certificates): the CA itself is kept.
    assert ca_init(d, broker_names=("x",)).returncode == 0
    assert (d / "ca.key").read_bytes() == ca_key


def test_judge_pure_rules():
    from datetime import UTC, datetime

    from fleetd.identity.rules import Binding, judge
    from fleetd.protocol.enrol import parse_document

    now = 1_800_000_000.0
    doc = parse_document(
        IdentitySigner.document(
            instance_id="i-0123456789abcdef0",
            instance_type="g5.xlarge",
            zone="us-east-1a",
            private_ip="10.0.0.1",
            pending_time=now - 60,
        )
    )
    s = EnrolSettings(region="us-east-1", max_document_age_s=900.0)
    assert judge(doc, "running", None, "k1", now, s) is None
    assert "region" in judge(doc, "running", None, "k1", now, EnrolSettings(region="eu-west-1"))
    assert "not running" in judge(doc, "pending", None, "k1", now, s)
    assert "not an instance of this fleet" in judge(doc, None, None, "k1", now, s)
    assert "in the future" in judge(doc, "running", None, "k1", now - 3600, s)
    live, expired = Binding("k1", now + 100), Binding("k1", now - 100)
    assert "live certificate" in judge(doc, "running", live, "k2", now, s)
    assert judge(doc, "running", live, "k1", now + 86400, s) is None  # the key holder renews, however old the doc
    assert judge(doc, "running", expired, "k1", now, s) is None
    assert judge(doc, "running", expired, "k2", now, s) is None  # expired + fresh document: a re-enrolment
    assert "replayed" in judge(doc, "running", expired, "k2", now + 3600, s)
    assert datetime.fromtimestamp(now, UTC)  # (now is an ordinary epoch)


async def test_the_agent_renews_before_expiry(stack, ec2):
    stack["service"].settings = EnrolSettings(region="us-east-1", cert_lifetime_s=3.0, max_document_age_s=900.0)
    inst = await _launch(ec2)
    async with _node(stack, inst) as imds, ImdsClient(imds.url) as client:
        node = NodeEnrolment(stack["url"], client, imds.instance_id, stack["tmp"] / "renewing")
        await node.ensure()
        first = node.files.cert.read_bytes()
        renewer = asyncio.create_task(node.run())
        try:
            for _ in range(300):
                if node.enrolments >= 2:
                    break
                await asyncio.sleep(0.05)
        finally:
            renewer.cancel()
        assert node.enrolments >= 2 and node.files.cert.read_bytes() != first
        assert stack["service"].refused == 0


async def test_a_missing_ca_is_logged_and_the_daemon_component_keeps_running(tmp_path, capsys):
    from fleetd.config import FleetdConfig
    from fleetd.daemon import DaemonContext
    from fleetd.identity.server import enrolment_component

    cfg = FleetdConfig.model_validate(
        {
            "enrol": {
                "enabled": True,
                "ca_dir": str(tmp_path / "none"),
                "port": 0,
                "identity_certificate": str(tmp_path / "none.pem"),
            },
            "fleet": {"state_dir": str(tmp_path / "state")},
        }
    )
    ctx = DaemonContext(cfg)
    task = asyncio.create_task(enrolment_component(cfg)(ctx))
    await asyncio.sleep(0.5)
    assert not task.done()  # waiting for shutdown, not crashed
    ctx.stopping.set()
    await asyncio.wait_for(task, 5)
    assert "enrolment_unavailable" in capsys.readouterr().out


def test_ca_init_as_root_leaves_the_files_fleetd_needs_readable_by_its_group():
    """`fleetd ca init`, run as root as deploy/README.md says, wrote every key 0600 root: the
    fleetd service user could not read the CA key (enrolment never served) nor its own key."""
    import grp
    import os
    import shutil
    import subprocess
    import tempfile

    if os.geteuid() != 0:
        pytest.fail("this test runs as root, as CI and the deploy-in-a-box tests do")
    group = grp.getgrgid(os.getgid() if os.getgid() != 0 else 1).gr_name  # any group but root's
    base = Path(tempfile.mkdtemp(prefix="fleetd-ca-", dir="/tmp"))
    base.chmod(0o755)
    try:
        d = base / "ca"
        out = ca_init(d, "--group", group)
        assert out.returncode == 0, out.stderr
        gid = grp.getgrnam(group).gr_gid
        for name in ("ca.key", "ca.crt", "fleetd-controller.key", "fleetd-controller.crt"):
            st = (d / name).stat()
            assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (gid, 0o640), name
        assert stat.S_IMODE((d / "server.key").stat().st_mode) == 0o600  # the broker's: installed for it apart
        # A process of another user in that group (as fleetd.service runs) reads the CA key.
        read = subprocess.run(
            ["setpriv", "--reuid=65534", f"--regid={gid}", "--clear-groups", "cat", str(d / "ca.key")],
            capture_output=True,
            timeout=30,
        )
        assert read.returncode == 0 and b"PRIVATE KEY" in read.stdout, read.stderr
        assert (
            subprocess.run(
                ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat", str(d / "ca.key")],
                capture_output=True,
                timeout=30,
            ).returncode
            != 0
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_enrol_url_may_name_the_controller_or_its_endpoint() -> None:
    # fleetd's launch template writes the endpoint (.../v1/enrol); a node's own config names the
    # controller. The template's form used to get the path twice: every enrolment 404.
    from agent.node.enrol import endpoint_of
    from fleetd.adapters.launch_template import enrol_url
    from fleetd.config import FleetdConfig

    for url in ("http://10.0.1.10:8440", "http://10.0.1.10:8440/", "http://10.0.1.10:8440/v1/enrol"):
        assert endpoint_of(url) == "http://10.0.1.10:8440/v1/enrol"
    assert endpoint_of(enrol_url(FleetdConfig())).endswith(":8440/v1/enrol")
    assert not endpoint_of(enrol_url(FleetdConfig())).endswith("/v1/enrol/v1/enrol")
