"""deploy/cloudformation/events.yaml: lints clean, matches the SQS intake, and works when deployed.

Deployed into moto, the stack's rule routes the three EC2 event types (and nothing else) into the
queue, and each delivered body is one the controller's SQS intake accepts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
import yaml

from fleetd.intake import sqs as sqs_intake
from fleetd.intake.events import InstanceStateChanged, InterruptionNotice, RebalanceRecommended
from tests.harness.moto import NO_RETRIES

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "deploy" / "cloudformation" / "events.yaml"


class CfnLoader(yaml.SafeLoader):
    """YAML with CloudFormation's short-form intrinsics (!Ref, !GetAtt, ...) as plain dicts."""


def _intrinsic(loader: yaml.SafeLoader, suffix: str, node: yaml.Node):
    name = "Ref" if suffix == "Ref" else f"Fn::{suffix}"
    if isinstance(node, yaml.ScalarNode):
        value = loader.construct_scalar(node)
        if suffix == "GetAtt":
            value = value.split(".", 1)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)
    return {name: value}


CfnLoader.add_multi_constructor("!", _intrinsic)


def template() -> dict:
    return yaml.load(TEMPLATE.read_text(), Loader=CfnLoader)


def resources_of(kind: str) -> dict[str, dict]:
    return {k: r for k, r in template()["Resources"].items() if r["Type"] == kind}


def test_cfn_lint_is_clean():
    cfn_lint = Path(sys.executable).parent / "cfn-lint"
    result = subprocess.run([str(cfn_lint), str(TEMPLATE)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_pattern_is_the_one_the_sqs_intake_handles():
    (rule,) = resources_of("AWS::Events::Rule").values()
    assert rule["Properties"]["EventPattern"] == sqs_intake.EVENT_PATTERN
    queues = resources_of("AWS::SQS::Queue")
    assert set(queues) == {"EventsQueue", "SecondQueue", "ThirdQueue"}
    # The other fleets' queues are targets of the same rule, present only when named.
    cond3, three, rest = rule["Properties"]["Targets"]["Fn::If"]
    cond2, two, one = rest["Fn::If"]
    assert (cond3, cond2) == (queues["ThirdQueue"]["Condition"], queues["SecondQueue"]["Condition"])
    for targets, names in (
        (three, ["EventsQueue", "SecondQueue", "ThirdQueue"]),
        (two, ["EventsQueue", "SecondQueue"]),
        (one, ["EventsQueue"]),
    ):
        assert [t["Arn"] for t in targets] == [{"Fn::GetAtt": [n, "Arn"]} for n in names]


def test_only_this_rule_may_send_to_the_queue_and_the_controller_may_read_it():
    (rule_name,) = resources_of("AWS::Events::Rule")
    policies = resources_of("AWS::SQS::QueuePolicy")
    assert len(policies) == len(resources_of("AWS::SQS::Queue"))  # every queue fenced
    for policy in policies.values():
        (statement,) = policy["Properties"]["PolicyDocument"]["Statement"]
        assert statement["Principal"] == {"Service": "events.amazonaws.com"}
        assert statement["Action"] == "sqs:SendMessage"
        assert statement["Condition"]["ArnEquals"]["aws:SourceArn"] == {"Fn::GetAtt": [rule_name, "Arn"]}
    default_queue = template()["Parameters"]["QueueName"]["Default"]
    controller = json.loads((ROOT / "deploy" / "iam" / "controller-policy.json").read_text())
    sqs_resources = [s["Resource"] for s in controller["Statement"] if s["Action"][0].startswith("sqs:")]
    assert sqs_resources == [f"arn:aws:sqs:*:*:{default_queue}"]


def _event(detail_type: str, detail: dict) -> dict:
    return {"Source": "aws.ec2", "DetailType": detail_type, "Detail": json.dumps(detail)}


# moto's CloudFormation does not model queue policies (checked statically above).
@pytest.mark.filterwarnings("ignore:Tried to parse AWS..SQS..QueuePolicy:UserWarning")
def test_deployed_stack_delivers_the_three_ec2_event_types_to_the_intake(moto_endpoint):
    kwargs = {"endpoint_url": moto_endpoint, "region_name": "us-east-1", "config": NO_RETRIES}
    cfn = boto3.client("cloudformation", **kwargs)
    cfn.create_stack(StackName="fleetd-events", TemplateBody=TEMPLATE.read_text())
    stack = cfn.describe_stacks(StackName="fleetd-events")["Stacks"][0]
    assert stack["StackStatus"] == "CREATE_COMPLETE"
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack["Outputs"]}
    iid = "i-0123456789abcdef0"
    boto3.client("events", **kwargs).put_events(
        Entries=[
            _event(sqs_intake.SPOT_WARNING, {"instance-id": iid, "instance-action": "terminate"}),
            _event(sqs_intake.REBALANCE, {"instance-id": iid}),
            _event(sqs_intake.STATE_CHANGE, {"instance-id": iid, "state": "shutting-down"}),
            _event("EC2 Instance Scheduled Event", {"instance-id": iid}),  # not ours: filtered
        ]
    )
    sqs = boto3.client("sqs", **kwargs)
    bodies: list[str] = []
    deadline = time.monotonic() + 10
    while len(bodies) < 3 and time.monotonic() < deadline:
        resp = sqs.receive_message(QueueUrl=outputs["QueueUrl"], MaxNumberOfMessages=10, WaitTimeSeconds=1)
        bodies += [m["Body"] for m in resp.get("Messages", [])]
    events = [sqs_intake.parse_event(b, received_at=time.time()) for b in bodies]
    assert sorted(type(e).__name__ for e in events) == sorted(
        [InterruptionNotice.__name__, RebalanceRecommended.__name__, InstanceStateChanged.__name__]
    )
    assert all(e.instance_id == iid for e in events)
    leftover = sqs.receive_message(QueueUrl=outputs["QueueUrl"], MaxNumberOfMessages=10, WaitTimeSeconds=1)
    assert not leftover.get("Messages"), "an event type outside the pattern reached the queue"


@pytest.mark.filterwarnings("ignore:Tried to parse AWS..SQS..QueuePolicy:UserWarning")
def test_deployed_stack_gives_two_fleets_every_event_each_on_its_own_queue(moto_endpoint):
    """Several fleets, one account, one rule: each queue receives every event (fan-out), so one
    fleet's consumer can never delete a notice another fleet needs."""
    kwargs = {"endpoint_url": moto_endpoint, "region_name": "us-east-1", "config": NO_RETRIES}
    cfn = boto3.client("cloudformation", **kwargs)
    cfn.create_stack(
        StackName="fleetd-events-2",
        TemplateBody=TEMPLATE.read_text(),
        Parameters=[
            {"ParameterKey": "QueueName", "ParameterValue": "fleetd-events-jobA"},
            {"ParameterKey": "SecondQueueName", "ParameterValue": "fleetd-events-jobB"},
        ],
    )
    stack = cfn.describe_stacks(StackName="fleetd-events-2")["Stacks"][0]
    assert stack["StackStatus"] == "CREATE_COMPLETE"
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack["Outputs"]}
    assert "ThirdQueueUrl" not in outputs
    ids = ["i-0a000000000000001", "i-0b000000000000002"]
    boto3.client("events", **kwargs).put_events(
        Entries=[_event(sqs_intake.SPOT_WARNING, {"instance-id": iid, "instance-action": "terminate"}) for iid in ids]
    )
    sqs = boto3.client("sqs", **kwargs)
    for key in ("QueueUrl", "SecondQueueUrl"):
        got: list[str] = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            resp = sqs.receive_message(QueueUrl=outputs[key], MaxNumberOfMessages=10, WaitTimeSeconds=1)
            got += [
                sqs_intake.parse_event(m["Body"], received_at=time.time()).instance_id for m in resp.get("Messages", [])
            ]
        assert sorted(got) == ids, key
