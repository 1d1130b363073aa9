"""Where the region comes from (fleetd/shared/aws_region.py): the config, the environment, the
profile, the instance; never a silent us-east-1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent.doubles.fake_imds import FakeImds
from fleetd.adapters.region import instance_region, resolve_region
from fleetd.shared.aws_region import region_of_zone
from fleetd.shared.settings import AwsConfig


@pytest.fixture(autouse=True)
def no_ambient_region(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))


def test_the_config_wins_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    aws = AwsConfig(region="eu-west-1")
    assert (aws.region, aws.region_source) == ("eu-west-1", "config")


async def test_then_the_environment_then_the_profile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-central-1")
    assert (AwsConfig().region, AwsConfig().region_source) == ("eu-central-1", "environment (AWS_DEFAULT_REGION)")
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    assert AwsConfig().region == "ap-south-1"
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    conf = tmp_path / "aws-config"
    conf.write_text("[default]\nregion = us-west-2\n[profile train]\nregion = eu-north-1\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(conf))
    # The profile takes a file read: asked at start, with the instance after it.
    assert AwsConfig().region == ""
    found = await resolve_region(AwsConfig(), imds_url="http://127.0.0.1:9")
    assert found is not None and (found.region, found.region_source) == ("us-west-2", "profile (default)")
    named = await resolve_region(AwsConfig(profile="train"), imds_url="http://127.0.0.1:9")
    assert named is not None and (named.region, named.region_source) == ("eu-north-1", "profile (train)")


def test_nothing_found_is_empty_not_us_east_1() -> None:
    assert AwsConfig().region == ""
    # A local endpoint (moto, LocalStack) runs in us-east-1, and says why.
    local = AwsConfig(endpoint_url="http://127.0.0.1:5000")
    assert (local.region, local.region_source) == ("us-east-1", "local endpoint default")


@pytest.mark.parametrize(
    ("zone", "region"),
    [
        ("us-east-1a", "us-east-1"),
        ("eu-west-3c", "eu-west-3"),
        ("us-west-2-lax-1a", "us-west-2"),
        ("us-gov-west-1b", "us-gov-west-1"),
    ],
)
def test_region_of_zone(zone: str, region: str) -> None:
    assert region_of_zone(zone) == region


async def test_the_instances_region_comes_from_imds() -> None:
    async with FakeImds(zone="eu-west-1b") as fake:
        assert await instance_region(fake.url) == "eu-west-1"
        found = await resolve_region(AwsConfig(), imds_url=fake.url)
        assert found is not None and (found.region, found.region_source) == ("eu-west-1", "instance (IMDS)")
    assert await instance_region("http://127.0.0.1:9", timeout_s=0.5) is None
    assert await resolve_region(AwsConfig(), imds_url="http://127.0.0.1:9") is None


def test_fleetd_run_off_ec2_with_no_region_refuses_with_the_ways_to_give_one(tmp_path: Path) -> None:
    conf = tmp_path / "fleetd.toml"
    conf.write_text(f'[fleet]\nstate_dir = "{tmp_path}"\n')
    out = subprocess.run(
        [sys.executable, "-m", "fleetd.cli", "run", "--config", str(conf), "--dry-run", "--passes", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "AWS_CONFIG_FILE": str(tmp_path / "none"), "HOME": str(tmp_path)},
    )
    assert out.returncode == 2 and "no AWS region" in out.stderr and "AWS_REGION" in out.stderr, out.stderr
