"""`fleetd doctor` against moto (behind the fault proxy, which answers the Service Quotas API as
AWS does), a real mosquitto and a listening store port: all ok on a good set-up; a missing bucket,
a denied action and a zero spot quota each named with its fix, and the exit code says so."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetd.commands.doctor import all_checks
from fleetd.config import EventsConfig, FleetdConfig
from fleetd.doctor.result import Status, exit_code, fatal, render
from fleetd.shared.settings import MqttConfig, RendezvousConfig
from tests.reconcile_support import Cloud

G_SPOT = "L-3819A6DF"  # All G and VT Spot Instance Requests: g5.xlarge and g4dn.xlarge draw on it


@pytest.fixture
def store_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


async def good_setup(cloud: Cloud, tmp_path: Path, mosquitto, store_port: int) -> FleetdConfig:
    base = cloud.config(tmp_path)
    bucket = base.checkpoints.bucket
    async with cloud.session.create_client("s3", endpoint_url=cloud.moto, region_name="us-east-1") as s3:
        await s3.create_bucket(Bucket=bucket)
    async with cloud.session.create_client("sqs", endpoint_url=cloud.moto, region_name="us-east-1") as sqs:
        url = (await sqs.create_queue(QueueName="fleetd-events"))["QueueUrl"]
    cloud.proxy.quotas = {G_SPOT: 64.0}
    return base.model_copy(
        update={
            "mqtt": MqttConfig(url=mosquitto.url),
            "rendezvous": RendezvousConfig(host="127.0.0.1", port=store_port),
            "events": EventsConfig(sqs_queue_url=url),
        }
    )


def by_name(checks) -> dict:
    return {c.name: c for c in checks}


async def test_a_good_setup_is_all_ok(cloud: Cloud, tmp_path: Path, mosquitto, store_port: int) -> None:
    cfg = await good_setup(cloud, tmp_path, mosquitto, store_port)
    checks = await all_checks(cfg, None)
    text = render(checks)
    assert exit_code(checks) == 0, text
    assert all(c.status in (Status.OK, Status.SKIP) for c in checks), text
    found = by_name(checks)
    for name in (
        "region",
        "credentials",
        "ec2:Describe*",
        "ec2:RunInstances",
        "subnets",
        "ami",
        "launch template",
        f"spot quota {G_SPOT}",
        "bucket",
        "event queue",
        "broker",
        "rendezvous store",
    ):
        assert found[name].status is Status.OK, (name, text)
    assert found["region"].detail == "us-east-1 (from config)"
    assert "64 vCPUs" in found[f"spot quota {G_SPOT}"].detail


async def test_a_missing_bucket_a_denied_action_and_a_zero_quota_are_named_with_their_fix(
    cloud: Cloud, tmp_path: Path, mosquitto, store_port: int
) -> None:
    cfg = await good_setup(cloud, tmp_path, mosquitto, store_port)
    cfg = cfg.model_copy(update={"checkpoints": cfg.checkpoints.model_copy(update={"bucket": "no-such-bucket"})})
    cloud.proxy.quotas = {G_SPOT: 0.0}
    cloud.proxy.fail("RunInstances", "UnauthorizedOperation")
    checks = await all_checks(cfg, None)
    found = by_name(checks)
    assert exit_code(checks) == 1
    bucket = found["bucket"]
    assert (
        bucket.status is Status.FAIL
        and "does not exist" in bucket.detail
        and "aws s3 mb s3://no-such-bucket" in bucket.fix
    )
    launch = found["ec2:RunInstances"]
    assert (
        launch.status is Status.FAIL
        and "UnauthorizedOperation" in launch.detail
        and "controller-policy.json" in launch.fix
    )
    quota = found[f"spot quota {G_SPOT}"]
    assert quota.status is Status.FAIL and "0 vCPUs" in quota.detail
    assert f"--quota-code {G_SPOT}" in quota.fix and "request-service-quota-increase" in quota.fix
    # What `fleetd run` would refuse to start on: the bucket and the launch permission.
    assert {c.name for c in fatal(checks)} == {"bucket", "ec2:RunInstances"}
    assert "      fix: create it in us-east-1: aws s3 mb s3://no-such-bucket" in render(checks)


async def test_unreachable_broker_and_store_and_unreadable_ca(
    cloud: Cloud, tmp_path: Path, mosquitto, store_port: int
) -> None:
    cfg = await good_setup(cloud, tmp_path, mosquitto, store_port)
    ca = tmp_path / "ca"
    ca.mkdir()
    (ca / "ca.crt").write_text("x")
    cfg = cfg.model_copy(
        update={
            "mqtt": MqttConfig(url="mqtt://127.0.0.1:9"),
            "rendezvous": RendezvousConfig(host="127.0.0.1", port=9),
            "enrol": cfg.enrol.model_copy(update={"enabled": True, "ca_dir": ca}),
        }
    )
    found = by_name(await all_checks(cfg, None))
    assert found["broker"].status is Status.FAIL and "mosquitto" in found["broker"].fix
    assert found["rendezvous store"].status is Status.FAIL and "fleetd-rendezvous" in found["rendezvous store"].fix
    files = found["certificate files"]
    assert files.status is Status.FAIL and "ca.key does not exist" in files.detail and files.fatal


def test_fleetd_run_refuses_to_start_without_the_ca_it_signs_with(moto_endpoint: str, tmp_path: Path) -> None:
    """The enrolment endpoint signs node certificates with ca.key: a controller that cannot read
    it never issues one, and no node ever joins. `fleetd run` says so before it buys anything."""
    import subprocess
    import sys

    conf = tmp_path / "fleetd.toml"
    conf.write_text(
        f'[aws]\nendpoint_url = "{moto_endpoint}"\n[fleet]\nstate_dir = "{tmp_path / "state"}"\n'
        f'[enrol]\nenabled = true\nca_dir = "{tmp_path / "ca"}"\n'
    )
    out = subprocess.run(
        [sys.executable, "-m", "fleetd.cli", "run", "--config", str(conf), "--passes", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "certificate files" in out.stderr and "ca.key does not exist" in out.stderr
    assert "fix: fleetd ca init" in out.stderr and "not started" in out.stderr


async def test_fleetd_run_refuses_no_credentials_but_not_an_unreachable_aws(monkeypatch, tmp_path: Path) -> None:
    """No credentials is a definite answer; AWS not answering at boot is an outage the loop rides
    through (refusing would let systemd's start limit leave the controller failed for good)."""
    from aiobotocore.session import get_session

    from fleetd.doctor.preflight import preflight
    from fleetd.shared.settings import AwsConfig

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    cfg = FleetdConfig(aws=AwsConfig(region="us-east-1", endpoint_url="http://127.0.0.1:9"))
    (refused,) = await preflight(cfg, get_session())
    assert refused.name == "credentials" and refused.fatal
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    assert await preflight(cfg, get_session()) == []


async def test_each_other_region_a_team_may_move_the_job_to_has_its_bucket_and_image_checked(
    cloud: Cloud, tmp_path: Path, mosquitto, store_port: int
) -> None:
    from fleetd.config import RegionSettings

    cfg = await good_setup(cloud, tmp_path, mosquitto, store_port)
    west = RegionSettings(region="us-west-2", bucket="ckpt-west", ami_id="ami-12345678")
    cfg = cfg.model_copy(update={"team": cfg.team.model_copy(update={"member": True, "regions": (west,)})})
    found = by_name(await all_checks(cfg, None))
    bucket, ami = found["bucket (us-west-2)"], found["ami (us-west-2)"]
    assert bucket.status is Status.FAIL and "aws s3 mb s3://ckpt-west --region us-west-2" in bucket.fix
    assert ami.status is Status.FAIL and "ami-12345678" in ami.detail
    # Another region's trouble is the doctor's to report, not a reason for this region not to start.
    assert not {c.name for c in fatal(list(found.values()))} & {"bucket (us-west-2)", "ami (us-west-2)"}

    where = {"endpoint_url": cloud.moto, "region_name": "us-west-2"}
    async with cloud.session.create_client("s3", **where) as s3:
        await s3.create_bucket(Bucket="ckpt-west", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    async with cloud.session.create_client("ec2", **where) as ec2:
        image = (await ec2.describe_images(Owners=["amazon"]))["Images"][0]["ImageId"]
    west = west.model_copy(update={"ami_id": image})
    cfg = cfg.model_copy(update={"team": cfg.team.model_copy(update={"regions": (west,)})})
    found = by_name(await all_checks(cfg, None))
    assert found["bucket (us-west-2)"].status is Status.OK and found["ami (us-west-2)"].status is Status.OK
