"""The production path end to end, on this box, with systemd as PID 1 in both machines
(tests/harness/deploy_box.py):

1. a control host set up by the very script deploy/README.md points to (deploy/control-host/setup.sh):
   mosquitto with the project's config inside Debian's stock one, fleetd-rendezvous and fleetd
   under their units as the fleetd user, the fleet CA readable by it, `fleetd doctor` green;
2. fleetd ships the job's workdir to S3 and buys a node (CreateFleet, moto);
3. a node machine boots from the image deploy/image/provision.sh built (Packer's script), and runs
   the user data of the launch template fleetd made, as cloud-init's final stage does;
4. its agent enrols for its MQTT certificate with the signed identity document, downloads and
   sets up the job's code, and trains under the controller's rendezvous;
5. a spot notice: the coordinated checkpoint becomes durable in S3, the node leaves and powers
   itself off through logind and polkit (fleet-agent's grant), as a real node does;
6. the training output is read back from the node's journal.

What stands in for AWS, and only that: moto behind the fault proxy (the machines share the host's
network), the fake IMDS on the host, AWS's identity certificate (an operator downloads it), and
unit drop-ins giving the units test credentials and those endpoints (production: the instance
role, the real endpoints). Running the user data is cloud-init's part: here the test runs it, as
root, in the booted node. What this box cannot prove is listed in tests/test_deploy_image.py."""

from __future__ import annotations

import asyncio
import base64
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from agent.doubles.fake_iid import IdentitySigner
from agent.doubles.fake_imds import FakeImds
from fleetd.adapters.faults import FaultProxy
from fleetd.protocol.checkpoints import CheckpointLayout, parse_latest
from tests.harness.deploy_box import (
    Machine,
    assert_host_port_free,
    build_control_host,
    copy_tree,
    unit_dropin,
    wait_active,
)
from tests.harness.ports import free_port

# Two systemd containers booted and set up from scratch: 412 s on the 2-core box beside two burners,
# over 600 s (the suite's hang bound) at load 10-15 (burner run 29, 2026-11-28). Every wait inside
# has its own bound; this one only catches a hang.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parent.parent
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
G_SPOT = "L-3819A6DF"
FLEET = "boxtest"
JOB_DIR = "/srv/fleetd-jobs/toy"  # the user's project on the control host
BUCKET = "fleetd-checkpoints"


def fleetd_toml(proxy_url: str, ami: str, store: int, metrics: int, enrol: int) -> str:
    return f"""
[aws]
region = "us-east-1"
endpoint_url = "{proxy_url}"

[fleet]
name = "{FLEET}"
min_nodes = 1
max_nodes = 1

[budget]
total_usd = 5.0
max_usd_per_hour = 10.0

[capacity]
instance_types = ["g5.xlarge"]
ami_id = "{ami}"

[checkpoints]
bucket = "{BUCKET}"

[mqtt]
url = "mqtts://localhost:8883"
ca_file = "/etc/fleetd/ca/ca.crt"
cert_file = "/etc/fleetd/ca/fleetd-controller.crt"
key_file = "/etc/fleetd/ca/fleetd-controller.key"

[rendezvous]
host = "127.0.0.1"
port = {store}

[metrics]
port = {metrics}

[enrol]
enabled = true
port = {enrol}
identity_certificate = "/etc/fleetd/aws-identity-rsa.pem"

[job]
file = "{JOB_DIR}/job.toml"
"""


# The demo's toy project as a user would submit it, paced so that it is still training when the
# notice comes (agent/examples/toy_job/job.toml explains the keys), with a pip setup as most
# projects have (the toy's own only checks its virtualenv).
JOB_TOML = """
version = 1
name = "toy"
workdir = "."
setup = ["python -m pip install --quiet --no-index -r requirements.txt"]
max_restarts = 3

[run]
module = "train_toy"
args = ["--steps", "100000", "--step-sleep", "0.05"]
nproc_per_node = 1

[checkpoint]
mode = "library"
"""


def _creds() -> dict[str, str]:
    return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


@pytest.fixture
def cloud(moto_endpoint: str):
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1", **_creds())
    s3.create_bucket(Bucket=BUCKET)
    ec2 = boto3.client("ec2", endpoint_url=moto_endpoint, region_name="us-east-1", **_creds())
    named = [{"Name": "name", "Values": ["amzn2-ami-hvm-2.0*"]}]
    ami = ec2.describe_images(Owners=["amazon"], Filters=named)["Images"][0]["ImageId"]
    with FaultProxy(moto_endpoint, quotas={G_SPOT: 64.0}) as proxy:
        yield proxy.url, ami, ec2, s3


@pytest.fixture
def imds_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop in a thread for the node's fake IMDS (the test itself is synchronous)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _our_instance(ec2, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp = ec2.describe_instances(
            Filters=[
                {"Name": "tag:fleetd:fleet", "Values": [FLEET]},
                {"Name": "instance-state-name", "Values": ["running"]},
            ]
        )
        found = [i for r in resp["Reservations"] for i in r["Instances"]]
        if found:
            return found[0]
        time.sleep(1)
    raise AssertionError(f"fleetd bought no node in {timeout:.0f} s")


def _user_data(ec2) -> str:
    resp = ec2.describe_launch_template_versions(LaunchTemplateName=f"fleetd-{FLEET}", Versions=["$Latest"])
    return base64.b64decode(resp["LaunchTemplateVersions"][0]["LaunchTemplateData"]["UserData"]).decode()


def _journal(machine: Machine, *args: str) -> str:
    return machine.run("journalctl", "--no-pager", "-o", "cat", *args, check=False, timeout=60).stdout


def _wait_for(what: str, cond, timeout: float, dump) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not in {timeout:.0f} s\n{dump()}")
        time.sleep(1)


def test_a_job_runs_on_the_production_path_from_control_host_to_a_node_that_powers_itself_off(
    cloud, node_image: Path, imds_loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    proxy_url, ami, ec2, s3 = cloud
    store, metrics, enrol = free_port(), free_port(), free_port()
    signer = IdentitySigner.generate()

    # ------------------------------------------------------------------ the control host
    host_work = tmp_path / "control"
    host_work.mkdir()

    def user_project(root: Path) -> None:
        project = root / JOB_DIR.lstrip("/")
        shutil.copytree(ROOT / "agent" / "examples" / "toy_job", project, ignore=shutil.ignore_patterns("__pycache__"))
        (project / "job.toml").write_text(JOB_TOML)
        # pip in the job's virtualenv on the node image, offline: numpy is in the image already.
        (project / "requirements.txt").write_text("numpy\n")
        for p in (project, *project.rglob("*")):
            p.chmod(0o755 if p.is_dir() else 0o644)

    host_root = build_control_host(host_work, fleetd_toml(proxy_url, ami, store, metrics, enrol), before=user_project)
    signer.write_certificate(host_root / "etc/fleetd/aws-identity-rsa.pem")
    unit_dropin(host_root, "fleetd.service", "credentials.conf", CREDENTIALS)
    host = Machine(host_root, "fleetd-control-host")
    node: Machine | None = None
    assert_host_port_free(8883, "the control host's mosquitto (deploy/mosquitto/mosquitto.conf)")
    try:
        host.boot()
        wait_active(host, ("mosquitto", "fleetd-rendezvous", "fleetd"))
        for unit in ("fleetd", "fleetd-rendezvous"):
            assert host.run("systemctl", "show", "-p", "User", "--value", unit).stdout.strip() == "fleetd", unit
        env = [f"{k}={v}" for k, v in CREDENTIALS.items()]
        doctor = host.run(
            "env", *env, "fleetd", "doctor", "--config", "/etc/fleetd/fleetd.toml", check=False, timeout=120
        )
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert "certificate files: fleetd reads" in doctor.stdout
        assert "broker: mqtts://localhost:8883: TLS handshake with the controller's certificate" in doctor.stdout
        controller = _journal(host, "-u", "fleetd")
        assert '"aws_region"' in controller and "intake_mqtt_connected" in controller, controller[-3000:]

        # ------------------------------------------------------------------ fleetd buys a node
        inst = _our_instance(ec2)
        iid = inst["InstanceId"]
        user_data = _user_data(ec2)
        code_keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", []) if "/code/" in o["Key"]]
        assert len(code_keys) == 1, code_keys  # the workdir, packed and uploaded by `fleetd run`
        assert code_keys[0].split("/")[-1].removesuffix(".tar.gz") in user_data  # its digest names it

        imds = FakeImds(
            instance_id=iid,
            instance_type=inst["InstanceType"],
            zone=inst["Placement"]["AvailabilityZone"],
            signer=signer,
        )
        imds_url = asyncio.run_coroutine_threadsafe(imds.start("127.0.0.1", 0), imds_loop).result(30)

        # ------------------------------------------------------------------ the node boots
        node_root = tmp_path / "node"
        node_root.mkdir()
        copy_tree(node_image, node_root)
        unit_dropin(
            node_root,
            "fleet-agent.service",
            "box.conf",
            {**CREDENTIALS, "FLEETD_NODE__IMDS_URL": imds_url, "FLEETD_AWS__ENDPOINT_URL": proxy_url},
        )
        cloud_dir = node_root / "var/lib/cloud/instance"
        cloud_dir.mkdir(parents=True)
        (cloud_dir / "user-data.txt").write_text(user_data)
        (cloud_dir / "user-data.txt").chmod(0o700)
        node = Machine(node_root, "fleetd-node")
        node.boot()
        ran = node.run("/bin/bash", "/var/lib/cloud/instance/user-data.txt", check=False, timeout=180)
        assert ran.returncode == 0, ran.stdout + ran.stderr + _journal(node, "-u", "fleet-agent")[-3000:]
        agent_env = (node_root / "etc/fleetd/agent.env").read_text()
        assert f"FLEETD_NODE__FLEET={FLEET}" in agent_env and "FLEETD_JOB__CODE_DIGEST=" in agent_env

        def agent_log() -> str:
            return (
                _journal(node, "-u", "fleet-agent")[-6000:] + "\n--- fleetd:\n" + _journal(host, "-u", "fleetd")[-3000:]
            )

        _wait_for("the node trains", lambda: "train_toy: step" in _journal(node, "-u", "fleet-agent"), 300, agent_log)
        # The workers' lines carry the job's fields in the node's journal, the rank one of them (the
        # text is the worker's own: torchrun's "[0]:" prefix became the field).
        ranked = _journal(node, "FLEETD_JOB=toy", f"FLEETD_NODE={iid}", "FLEETD_RANK=0").splitlines()
        assert any(line.startswith("train_toy: rank 0 of 1") for line in ranked), ranked[-20:]
        broker_log = (host_root / "var/log/mosquitto/mosquitto.log").read_text(errors="replace")
        assert f"u'{iid}'" in broker_log  # the node connected with the certificate it enrolled for

        # ------------------------------------------------------------------ a spot notice
        t_notice = time.monotonic()
        imds_loop.call_soon_threadsafe(lambda: imds.schedule_notice(in_s=0.0, action="terminate", action_in_s=120.0))
        assert node.proc is not None
        try:
            node.proc.wait(timeout=110)  # within the notice: it powers itself off
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the node did not power off within its notice\n{agent_log()}") from None
        powered_off_s = time.monotonic() - t_notice

        # Read back from the node's persistent journal, after it is gone.
        journal_dir = str(node_root / "var/log/journal")
        gone = subprocess.run(
            ["journalctl", "--no-pager", "-o", "cat", "-D", journal_dir, "-u", "fleet-agent"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert "train_toy: step" in gone and "powering_off" in gone and "left on a spot notice" in gone, gone[-4000:]
        assert "emergency" in gone or "drain" in gone

        # The notice's checkpoint is durable in S3: the job's `latest` names a step it trained to.
        layout = CheckpointLayout("checkpoints", "toy")
        latest = parse_latest(
            s3.get_object(Bucket=BUCKET, Key=layout.latest_key())["Body"].read(), source="latest", job="toy"
        )
        assert latest.step >= 1
        manifest = s3.list_objects_v2(Bucket=BUCKET, Prefix=layout.manifest_key(latest.step))
        assert manifest.get("KeyCount", 0) == 1
        # The controller heard the notice.
        assert "notice" in _journal(host, "-u", "fleetd")
        print(f"deploy flow: node powered off {powered_off_s:.1f} s after the notice; latest step {latest.step}")
    finally:
        if node is not None:
            node.poweroff()
        host.poweroff()
        asyncio.run_coroutine_threadsafe(imds.stop(), imds_loop).result(10) if "imds" in locals() else None
    broker_log = (host_root / "var/log/mosquitto/mosquitto.log").read_text(errors="replace")
    assert "u'fleetd-controller'" in broker_log  # the controller connected with its certificate
    assert "already connected, closing old connection" not in broker_log
