"""The aiobotocore EC2 adapter against moto server (through the fault proxy, which records the
requests exactly as AWS would receive them)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from fleetd.adapters.aws_errors import PermanentAwsError
from fleetd.adapters.ec2 import (
    TAG_FLEET,
    TAG_JOB,
    TAG_LAUNCH,
    TAG_MARKET,
    TAG_POOL,
    AioEc2,
    LaunchSpec,
    launch_token,
)
from fleetd.adapters.ec2_pools import resolve_pools, subnets_by_zone
from fleetd.adapters.launch_template import AGENT_ENV_FILE, agent_user_data, ensure_launch_template
from fleetd.config import GpuRequirements
from fleetd.policy.model import Market, PoolId
from tests.reconcile_support import ZONES, Cloud

A = PoolId("g4dn.xlarge", "us-east-1a")
B = PoolId("g5.xlarge", "us-east-1b")


async def adapter(cloud: Cloud, client, tmp_path: Path, fleet: str = "t") -> AioEc2:
    cfg = cloud.config(tmp_path, fleet=fleet)
    template = await ensure_launch_template(client, cfg)
    return AioEc2(
        client,
        fleet=fleet,
        job="train",
        template=template,
        subnets_by_zone=await subnets_by_zone(client, cfg.capacity.subnet_ids),
    )


async def test_launch_template_pins_imdsv2_hop_limit_and_agent_user_data(cloud: Cloud, tmp_path: Path) -> None:
    cfg = cloud.config(tmp_path, instance_profile_arn="arn:aws:iam::123456789012:instance-profile/fleetd-node")
    async with cloud.client() as c:
        first = await ensure_launch_template(c, cfg)
        again = await ensure_launch_template(c, cfg)  # create once, then use
        assert first == again
        assert len(cloud.proxy.calls_of("CreateLaunchTemplate")) == 1
        versions = await c.describe_launch_template_versions(LaunchTemplateId=first.template_id)
    data = versions["LaunchTemplateVersions"][0]["LaunchTemplateData"]
    assert data["ImageId"] == cloud.ami
    assert data["MetadataOptions"]["HttpTokens"] == "required"
    assert data["MetadataOptions"]["HttpPutResponseHopLimit"] == 1
    assert data["IamInstanceProfile"]["Arn"].endswith("instance-profile/fleetd-node")
    user_data = base64.b64decode(data["UserData"]).decode()
    assert AGENT_ENV_FILE in user_data and "FLEETD_NODE__FLEET=t" in user_data
    assert "FLEETD_MQTT__URL=mqtt://127.0.0.1:1883" in user_data
    assert "password" not in user_data.lower()


async def test_a_new_ami_or_user_data_reaches_new_nodes_through_a_new_version(cloud: Cloud, tmp_path: Path) -> None:
    """The managed template was reused at "$Default": a new AMI (or a new controller address in
    the user data) never reached a node launched afterwards."""
    cfg = cloud.config(tmp_path)
    async with cloud.client() as c:
        first = await ensure_launch_template(c, cfg)
        images = (await c.describe_images(Owners=["amazon"]))["Images"]
        other_ami = next(i["ImageId"] for i in images if i["ImageId"] != cloud.ami)
        newer = await ensure_launch_template(c, cloud.config(tmp_path, ami_id=other_ami))
        assert newer.template_id == first.template_id and (first.version, newer.version) == ("1", "2")
        assert newer.spec() == {"LaunchTemplateId": first.template_id, "Version": "2"}
        # Unchanged since: that version is used as it is, nothing new is written.
        again = await ensure_launch_template(c, cloud.config(tmp_path, ami_id=other_ami))
        assert again == newer and len(cloud.proxy.calls_of("CreateLaunchTemplateVersion")) == 1
        got = await c.describe_launch_template_versions(LaunchTemplateId=first.template_id, Versions=["2"])
    assert got["LaunchTemplateVersions"][0]["LaunchTemplateData"]["ImageId"] == other_ami


async def test_user_data_carries_enrolment_the_ca_and_the_job(cloud: Cloud, tmp_path: Path, monkeypatch) -> None:
    """The image bakes only the example agent.toml: enrolment, the CA and the job come from the
    controller's config at boot."""
    from fleetd.identity.ca import LocalCa

    ca_dir = tmp_path / "ca"
    LocalCa.init(ca_dir, server_names=("broker.fleet.internal",), clients=("fleetd-controller",))
    base = cloud.config(tmp_path)
    cfg = base.model_copy(
        update={
            "enrol": base.enrol.model_copy(update={"enabled": True, "ca_dir": ca_dir}),
            "rendezvous": base.rendezvous.model_copy(update={"host": "10.0.0.5"}),
            "job": base.job.model_copy(update={"entrypoint": "train", "args": ("--lr", "0.1"), "nproc_per_node": 8}),
        }
    )
    user_data = agent_user_data(cfg)
    assert "FLEETD_NODE__ENROL_URL=http://10.0.0.5:8440/v1/enrol" in user_data
    assert "FLEETD_MQTT__CA_FILE=/etc/fleetd/mqtt/ca.crt" in user_data
    assert (ca_dir / "ca.crt").read_text().strip().splitlines()[1] in user_data
    assert "PRIVATE KEY" not in user_data
    assert "FLEETD_JOB__ENTRYPOINT=train" in user_data and "FLEETD_JOB__NPROC_PER_NODE=8" in user_data
    assert """FLEETD_JOB__ARGS='["--lr", "0.1"]'""" in user_data
    # The agent reads those overrides as the unit does (EnvironmentFile): they parse.
    import shlex

    from agent.config import AgentConfig

    block = user_data.split("<<'FLEETD_ENV'\n", 1)[1].split("\nFLEETD_ENV", 1)[0]
    for line in block.splitlines():
        key, value = line.split("=", 1)
        monkeypatch.setenv(key, shlex.split(value)[0])
    agent = AgentConfig()
    assert agent.job.args == ("--lr", "0.1") and agent.job.nproc_per_node == 8
    assert agent.node.enrol_url == "http://10.0.0.5:8440/v1/enrol"


async def test_named_template_must_exist_and_ami_is_required(cloud: Cloud, tmp_path: Path) -> None:
    async with cloud.client() as c:
        with pytest.raises(PermanentAwsError, match="does not exist"):
            await ensure_launch_template(c, cloud.config(tmp_path, launch_template="nope"))
        with pytest.raises(PermanentAwsError, match="ami_id is required"):
            await ensure_launch_template(c, cloud.config(tmp_path, ami_id=None))


async def test_create_fleet_request_shape_tags_and_pools(cloud: Cloud, tmp_path: Path) -> None:
    async with cloud.client() as c:
        ec2 = await adapter(cloud, c, tmp_path)
        token = launch_token("t", 0, 2, Market.SPOT, (A, B))
        result = await ec2.launch(
            LaunchSpec(token, 2, Market.SPOT, (A, B), max_price_per_hour=0.5, max_total_price=0.9)
        )
    req = cloud.proxy.calls_of("CreateFleet")[0]
    assert req["Type"] == "instant" and req["ClientToken"] == token and len(token) <= 64
    assert req["SpotOptions.AllocationStrategy"] == "price-capacity-optimized"
    assert req["SpotOptions.MaxTotalPrice"] == "0.9000"
    assert req["TargetCapacitySpecification.DefaultTargetCapacityType"] == "spot"
    assert req["TargetCapacitySpecification.TotalTargetCapacity"] == "2"
    assert [req[f"LaunchTemplateConfigs.1.Overrides.{n}.InstanceType"] for n in (1, 2)] == ["g4dn.xlarge", "g5.xlarge"]
    assert [req[f"LaunchTemplateConfigs.1.Overrides.{n}.SubnetId"] for n in (1, 2)] == [cloud.subnets[z] for z in ZONES]
    assert req["LaunchTemplateConfigs.1.Overrides.1.MaxPrice"] == "0.5000"
    tags = {
        req[k]: req[k.replace(".Key", ".Value")]
        for k in req
        if k.startswith("TagSpecification.1.Tag.") and k.endswith(".Key")
    }
    assert tags == {TAG_FLEET: "t", TAG_JOB: "train", TAG_LAUNCH: token, TAG_MARKET: "spot"}
    assert len(result.instances) == 2 and not result.failures
    live = await cloud.instances()
    assert {t["Key"]: t["Value"] for t in live[0]["Tags"]}[TAG_POOL] == str(A)
    assert all(i["InstanceLifecycle"] == "spot" and i["Placement"]["AvailabilityZone"] == "us-east-1a" for i in live)


async def test_on_demand_request_uses_prioritized_order(cloud: Cloud, tmp_path: Path) -> None:
    async with cloud.client() as c:
        ec2 = await adapter(cloud, c, tmp_path)
        result = await ec2.launch(LaunchSpec("tok-od", 1, Market.ON_DEMAND, (B, A), max_total_price=1.1))
        (inst,) = await ec2.list_instances()
    req = cloud.proxy.calls_of("CreateFleet")[0]
    assert req["OnDemandOptions.AllocationStrategy"] == "prioritized"
    assert "SpotOptions.AllocationStrategy" not in req and "LaunchTemplateConfigs.1.Overrides.1.MaxPrice" not in req
    assert result.instances[0].market is Market.ON_DEMAND
    assert (inst.pool, inst.market, inst.launch_token) == (B, Market.ON_DEMAND, "tok-od")


async def test_same_token_never_buys_twice(cloud: Cloud, tmp_path: Path) -> None:
    async with cloud.client() as c:
        ec2 = await adapter(cloud, c, tmp_path)
        spec = LaunchSpec("fleetd-same", 2, Market.SPOT, (A,))
        first = await ec2.launch(spec)
        again = await ec2.launch(spec)
    assert again.already_launched
    assert sorted(i.instance_id for i in again.instances) == sorted(i.instance_id for i in first.instances)
    assert len(cloud.proxy.calls_of("CreateFleet")) == 1
    assert len(await cloud.instances()) == 2


async def test_discovery_and_termination_are_limited_to_the_fleet_tag(cloud: Cloud, tmp_path: Path) -> None:
    async with cloud.client() as c:
        mine = await adapter(cloud, c, tmp_path / "a", fleet="t")
        other = await adapter(cloud, c, tmp_path / "b", fleet="other")
        await mine.launch(LaunchSpec("tok-mine", 1, Market.SPOT, (A,)))
        theirs = (await other.launch(LaunchSpec("tok-theirs", 1, Market.SPOT, (A,)))).instances[0].instance_id
        untagged = (await c.run_instances(ImageId=cloud.ami, MinCount=1, MaxCount=1))["Instances"][0]["InstanceId"]
        listed = await mine.list_instances()
        assert [i.launch_token for i in listed] == ["tok-mine"]
        done = await mine.terminate([listed[0].instance_id, theirs, untagged, "i-0123456789abcdef0"])
    assert done == [listed[0].instance_id]
    assert [r["InstanceId.1"] for r in cloud.proxy.calls_of("TerminateInstances")] == [listed[0].instance_id]
    assert len(await cloud.instances("other")) == 1


async def test_pools_from_gpu_requirements(cloud: Cloud) -> None:
    async with cloud.client() as c:
        resolved = await resolve_pools(
            c, instance_types=(), gpu=GpuRequirements(count=1, models=("A10G", "L4"), min_memory_gib=20), zones=ZONES
        )
        explicit = await resolve_pools(c, instance_types=("g5.xlarge",), gpu=None, zones=ZONES)
    types = {p.instance_type for p in resolved.pools}
    assert "g5.xlarge" in types and "g6.xlarge" in types
    assert not any(t.startswith(("g4dn", "p3", "g5.12x")) for t in types)  # T4/V100 or 4-GPU types
    assert all(resolved.hardware[t].gpu_model in ("A10G", "L4") and resolved.hardware[t].gpus == 1 for t in types)
    assert {p.zone for p in resolved.pools} == set(ZONES)
    assert explicit.pools == (PoolId("g5.xlarge", "us-east-1a"), PoolId("g5.xlarge", "us-east-1b"))
    assert explicit.hardware["g5.xlarge"].gpu_model == "A10G"


async def test_zones_default_to_the_subnets_or_the_region(cloud: Cloud) -> None:
    from fleetd.adapters.ec2_pools import default_zones

    async with cloud.client() as c:
        assert await default_zones(c, [cloud.subnets["us-east-1b"]]) == ("us-east-1b",)
        region = await default_zones(c, [])
    assert set(ZONES) <= set(region) and all(z.startswith("us-east-1") for z in region)
