"""A control host set up by the very script deploy/README.md points to (deploy/control-host/setup.sh),
in a Debian 12 machine booted with systemd as PID 1 (tests/harness/deploy_box.py): mosquitto with the
project's config inside Debian's stock one, fleetd-rendezvous and fleetd under their units as the
fleetd user, the fleet CA readable by it, and `fleetd doctor` green. AWS is moto behind the fault
proxy on the host (the machine shares the host's network); the only test scaffolding in the machine
is the AWS credentials drop-in (production has the instance role) and AWS's identity certificate
(an operator downloads it)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import boto3
import pytest

from agent.doubles.fake_iid import IdentitySigner
from fleetd.adapters.faults import FaultProxy
from tests.harness.deploy_box import base_rootfs, booted, build_wheel, copy_tree, nspawn, wheelhouse
from tests.harness.ports import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SRC = "/root/fleetd-src"  # where the machine sees the checkout's deploy/ and systemd/
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
G_SPOT = "L-3819A6DF"


def fleetd_toml(proxy_url: str, ami: str, store: int, metrics: int, enrol: int) -> str:
    return f"""
[aws]
region = "us-east-1"
endpoint_url = "{proxy_url}"

[fleet]
name = "boxtest"
min_nodes = 1
max_nodes = 1

[budget]
total_usd = 5.0
max_usd_per_hour = 10.0

[capacity]
instance_types = ["g5.xlarge"]
ami_id = "{ami}"

[checkpoints]
bucket = "fleetd-checkpoints"

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
"""


@pytest.fixture
def cloud(moto_endpoint: str):
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1", **_creds())
    s3.create_bucket(Bucket="fleetd-checkpoints")
    ec2 = boto3.client("ec2", endpoint_url=moto_endpoint, region_name="us-east-1", **_creds())
    named = [{"Name": "name", "Values": ["amzn2-ami-hvm-2.0*"]}]
    ami = ec2.describe_images(Owners=["amazon"], Filters=named)["Images"][0]["ImageId"]
    with FaultProxy(moto_endpoint, quotas={G_SPOT: 64.0}) as proxy:
        yield proxy.url, ami


def _creds() -> dict[str, str]:
    return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


def test_the_control_host_comes_up_under_systemd_and_the_doctor_is_green(cloud, tmp_path: Path) -> None:
    proxy_url, ami = cloud
    work = tmp_path
    wheel = build_wheel(work / "dist")
    wheels = wheelhouse(wheel)
    root = work / "root"
    root.mkdir()
    copy_tree(base_rootfs(), root)
    src = root / SRC.lstrip("/")
    src.mkdir(parents=True)
    for part in ("deploy", "systemd"):
        shutil.copytree(ROOT / part, src / part)
    shutil.copy(wheel, src / wheel.name)
    store, metrics, enrol = free_port(), free_port(), free_port()
    (src / "fleetd.toml").write_text(fleetd_toml(proxy_url, ami, store, metrics, enrol))
    res = nspawn(
        root,
        "/bin/bash",
        f"{SRC}/deploy/control-host/setup.sh",
        binds=((wheels, "/wheelhouse"),),
        env={
            "WHEEL": f"{SRC}/{wheel.name}",
            "BROKER_NAME": "localhost",
            "FLEETD_TOML": f"{SRC}/fleetd.toml",
            "PIP_ARGS": "--no-index --find-links /wheelhouse",
            "START": "no",  # not booted yet: the units start with the machine
        },
    )
    assert res.returncode == 0, f"setup.sh failed:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    # What an operator provides beside the script: AWS's identity certificate; the instance role
    # (here: moto's test credentials for the fleetd unit).
    IdentitySigner.generate().write_certificate(root / "etc/fleetd/aws-identity-rsa.pem")
    dropin = root / "etc/systemd/system/fleetd.service.d"
    dropin.mkdir(parents=True)
    (dropin / "credentials.conf").write_text(
        "[Service]\n" + "".join(f"Environment={k}={v}\n" for k, v in CREDENTIALS.items())
    )
    with booted(root, "fleetd-control-host") as host:
        deadline = time.monotonic() + 120
        units = ("mosquitto", "fleetd-rendezvous", "fleetd")
        while True:
            states = {u: host.run("systemctl", "is-active", u, check=False).stdout.strip() for u in units}
            if all(s == "active" for s in states.values()):
                break
            if time.monotonic() > deadline:
                logs = {u: host.run("journalctl", "-u", u, "--no-pager", "-n", "30", check=False).stdout for u in units}
                raise AssertionError(f"units not active: {states}\n{logs}")
            time.sleep(1)
        # The service user runs them.
        for unit in ("fleetd", "fleetd-rendezvous"):
            user = host.run("systemctl", "show", "-p", "User", "--value", unit).stdout.strip()
            assert user == "fleetd", unit
        env = [f"{k}={v}" for k, v in CREDENTIALS.items()]
        doctor = host.run(
            "env", *env, "fleetd", "doctor", "--config", "/etc/fleetd/fleetd.toml", check=False, timeout=120
        )
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert "certificate files: fleetd reads" in doctor.stdout
        assert "broker: mqtts://localhost:8883: TLS handshake with the controller's certificate" in doctor.stdout
        journal = host.run("journalctl", "-u", "fleetd", "--no-pager", "-o", "cat").stdout
        assert '"aws_region"' in journal and "intake_mqtt_connected" in journal, journal[-3000:]
    broker_log = (root / "var/log/mosquitto/mosquitto.log").read_text(errors="replace")
    assert "u'fleetd-controller'" in broker_log  # the controller connected with its certificate
    assert "already connected, closing old connection" not in broker_log
