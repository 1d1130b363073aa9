"""deploy/cloudformation/network.yaml: the control host's ports (the unauthenticated rendezvous
store above all) open only to the fleet's node security group; deployed into moto, EC2 holds
exactly those rules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import boto3
import yaml

from fleetd.config import EnrolConfig
from fleetd.shared.settings import RendezvousConfig
from tests.harness.moto import NO_RETRIES
from tests.test_deploy_events import CfnLoader

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "deploy" / "cloudformation" / "network.yaml"


def test_cfn_lint_is_clean_and_defaults_match_the_config():
    cfn_lint = Path(sys.executable).parent / "cfn-lint"
    result = subprocess.run([str(cfn_lint), str(TEMPLATE)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    params = yaml.load(TEMPLATE.read_text(), Loader=CfnLoader)["Parameters"]
    assert params["RendezvousPort"]["Default"] == RendezvousConfig().port
    assert params["EnrolPort"]["Default"] == EnrolConfig().port
    assert params["MqttPort"]["Default"] == 8883  # deploy/mosquitto/mosquitto.conf's listener


def test_deployed_groups_admit_the_store_broker_and_enrolment_only_from_fleet_nodes(moto_endpoint):
    kwargs = {"endpoint_url": moto_endpoint, "region_name": "us-east-1", "config": NO_RETRIES}
    ec2 = boto3.client("ec2", **kwargs)
    vpc = ec2.create_vpc(CidrBlock="10.20.0.0/16")["Vpc"]["VpcId"]
    cfn = boto3.client("cloudformation", **kwargs)
    cfn.create_stack(
        StackName="fleetd-network",
        TemplateBody=TEMPLATE.read_text(),
        Parameters=[{"ParameterKey": "VpcId", "ParameterValue": vpc}],
    )
    stack = cfn.describe_stacks(StackName="fleetd-network")["Stacks"][0]
    assert stack["StackStatus"] == "CREATE_COMPLETE"
    out = {o["OutputKey"]: o["OutputValue"] for o in stack["Outputs"]}
    nodes, control = out["NodeSecurityGroupId"], out["ControlHostSecurityGroupId"]
    groups = {g["GroupId"]: g for g in ec2.describe_security_groups(GroupIds=[nodes, control])["SecurityGroups"]}
    inbound = {
        gid: {
            (
                p["FromPort"],
                p["ToPort"],
                tuple(sorted(x["GroupId"] for x in p["UserIdGroupPairs"])),
                tuple(r["CidrIp"] for r in p.get("IpRanges", [])),
            )
            for p in g["IpPermissions"]
        }
        for gid, g in groups.items()
    }
    assert inbound[control] == {(29400, 29400, (nodes,), ()), (8883, 8883, (nodes,), ()), (8440, 8440, (nodes,), ())}
    assert inbound[nodes] == {(0, 65535, (nodes,), ())}
