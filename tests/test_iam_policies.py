"""deploy/iam: every EC2/SQS/S3/Pricing/DynamoDB call the code makes is allowed, and nothing much beyond it.

The calls are found statically: every ``<client>.<snake_method>(`` whose name is an operation of the
EC2, S3 or SQS service model (botocore's own list), and every ``get_paginator("<op>")``. Controller
code is fleetd/** (minus the local demo) plus any agent module it imports; node code is agent/**.
A small evaluator then checks each action (and, for S3, the resource and condition keys) against
the policy JSON, so a new call without a policy change fails here, not in production.
"""

from __future__ import annotations

import ast
import fnmatch
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import botocore.session
import pytest
from botocore import xform_name

from fleetd.adapters import ec2 as ec2_adapter
from fleetd.protocol.checkpoints import CheckpointLayout
from fleetd.shared.settings import CheckpointConfig, JobConfig

ROOT = Path(__file__).resolve().parent.parent
IAM = ROOT / "deploy" / "iam"
SERVICES = ("ec2", "s3", "sqs", "pricing", "dynamodb")
NOT_PRODUCTION = ("fleetd/demo/", "fleetd/commands/demo.py")

# IAM authorises these API operations under another action name.
IAM_ACTION_OF = {
    "sqs:DeleteMessageBatch": ("sqs:DeleteMessage",),
    "sqs:ChangeMessageVisibilityBatch": ("sqs:ChangeMessageVisibility",),
    "sqs:SendMessageBatch": ("sqs:SendMessage",),
    "s3:HeadObject": ("s3:GetObject",),
    "s3:HeadBucket": ("s3:ListBucket",),
    "s3:ListObjectsV2": ("s3:ListBucket",),
    "s3:ListObjects": ("s3:ListBucket",),
    "s3:DeleteObjects": ("s3:DeleteObject",),
    "s3:CreateMultipartUpload": ("s3:PutObject",),
    "s3:UploadPart": ("s3:PutObject",),
    "s3:CompleteMultipartUpload": ("s3:PutObject",),
    "s3:CopyObject": ("s3:GetObject", "s3:PutObject"),
    "s3:UploadPartCopy": ("s3:GetObject", "s3:PutObject"),
    # A transaction is authorised per item action (fleetd/ha/table.py: a ConditionCheck on the lease
    # item, then puts).
    "dynamodb:TransactWriteItems": ("dynamodb:ConditionCheckItem", "dynamodb:PutItem"),
    "s3:ListMultipartUploads": ("s3:ListBucketMultipartUploads",),
    "s3:ListParts": ("s3:ListMultipartUploadParts",),
}
# What one API call needs besides its own action (CreateFleet launches and tags instances with the
# template's instance profile).
IMPLIED = {
    "ec2:CreateFleet": ("ec2:RunInstances", "ec2:CreateTags", "iam:PassRole"),
    "ec2:RunInstances": ("ec2:CreateTags", "iam:PassRole"),
}
# Calls that exist only for moto/the local demo, never in production: with the reason.
NOT_GRANTED_ON_PURPOSE = {
    "s3:CreateBucket": "S3Bucket.ensure_bucket (demo and tests); operators create the bucket",
    "dynamodb:CreateTable": "DynamoTable.ensure ([ha] create_table: tests, trials); deploy/cloudformation/ha-state.yaml creates it",
}
BUCKET_ACTIONS = {"s3:ListBucket", "s3:ListBucketMultipartUploads", "s3:CreateBucket"}


# ------------------------------------------------------------------ static call extraction
def _operations() -> dict[str, dict[str, str]]:
    session = botocore.session.get_session()
    return {svc: {xform_name(op): op for op in session.get_service_model(svc).operation_names} for svc in SERVICES}


OPERATIONS = _operations()


@dataclass(frozen=True)
class Call:
    action: str  # "ec2:DescribeInstances"
    where: str  # "fleetd/adapters/ec2.py:123"


def _services_of(tree: ast.AST) -> tuple[str, ...]:
    """Services a file creates clients for; files handed a client (no create_client) could hold any."""
    created = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "create_client"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value in SERVICES
    }
    return tuple(sorted(created)) or SERVICES


def calls_in(path: Path) -> list[Call]:
    tree = ast.parse(path.read_text(), str(path))
    services = _services_of(tree)
    rel = path.relative_to(ROOT).as_posix()
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name = node.func.attr
        if name == "get_paginator" and node.args and isinstance(node.args[0], ast.Constant):
            name = node.args[0].value
        for svc in services:
            op = OPERATIONS[svc].get(name)
            if op is not None:
                out.append(Call(f"{svc}:{op}", f"{rel}:{node.lineno}"))
    return out


def _modules_imported(tree: ast.AST) -> set[str]:
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
    return mods


def controller_files() -> list[Path]:
    files = [
        p
        for p in sorted((ROOT / "fleetd").rglob("*.py"))
        if not p.relative_to(ROOT).as_posix().startswith(NOT_PRODUCTION)
    ]
    # Agent code the controller imports runs with the controller's role.
    imported = set()
    for p in files:
        imported |= {m for m in _modules_imported(ast.parse(p.read_text())) if m.startswith("agent.")}
    for mod in sorted(imported):
        base = ROOT / Path(*mod.split("."))
        files += [base.with_suffix(".py")] if base.with_suffix(".py").exists() else sorted(base.rglob("*.py"))
    return files


def node_files() -> list[Path]:
    return sorted((ROOT / "agent").rglob("*.py"))


def all_calls(files: Iterable[Path]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in files:
        for call in calls_in(path):
            found.setdefault(call.action, []).append(call.where)
    return found


def iam_actions(api_action: str) -> tuple[str, ...]:
    own = IAM_ACTION_OF.get(api_action, (api_action,))
    return (*own, *IMPLIED.get(api_action, ()))


# ------------------------------------------------------------------ a small policy evaluator
def load(name: str) -> dict:
    return json.loads((IAM / name).read_text())


def _listify(v) -> list:
    return v if isinstance(v, list) else [v]


def _condition_holds(op: str, key: str, expected, context: dict[str, list[str]]) -> bool:
    expected = [str(e) for e in _listify(expected)]
    present = key in context
    values = context.get(key, [])
    if op == "Null":
        return (not present) == (expected[0] == "true")
    if op.startswith("ForAllValues:"):
        inner = op.split(":", 1)[1]
        return all(_condition_holds(inner, key, expected, {key: [v]}) for v in values)
    if not present:
        return False
    if op in ("StringEquals", "ArnEquals"):
        return any(v in expected for v in values)
    if op in ("StringLike", "ArnLike"):
        return any(fnmatch.fnmatchcase(v, e) for v in values for e in expected)
    raise AssertionError(f"evaluator does not know condition operator {op}")


def _statement_applies(st: dict, action: str, resource: str | None, context: dict | None) -> bool:
    if not any(fnmatch.fnmatch(action.lower(), a.lower()) for a in _listify(st["Action"])):
        return False
    if resource is not None and not any(fnmatch.fnmatchcase(resource, r) for r in _listify(st["Resource"])):
        return False
    if context is not None:
        for op, clauses in st.get("Condition", {}).items():
            if not all(_condition_holds(op, k, v, context) for k, v in clauses.items()):
                return False
    return True


def allowed(policy: dict, action: str, resource: str | None = None, context: dict | None = None) -> bool:
    """IAM's rule: an explicit Deny wins, else any matching Allow. ``resource``/``context`` None:
    judge the action alone (some statement could allow it)."""
    stmts = [s for s in policy["Statement"] if _statement_applies(s, action, resource, context)]
    return any(s["Effect"] == "Allow" for s in stmts) and not any(s["Effect"] == "Deny" for s in stmts)


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", ["controller-policy.json", "node-policy.json"])
def test_policies_parse_and_are_least_privilege_shaped(name):
    policy = load(name)
    assert policy["Version"] == "2012-10-17"
    sids = [s["Sid"] for s in policy["Statement"]]
    assert len(sids) == len(set(sids))
    for st in policy["Statement"]:
        assert st["Effect"] == "Allow" and st["Action"] and st["Resource"]
        for action in _listify(st["Action"]):
            service, _, verb = action.partition(":")
            assert verb not in ("*", "") and service in (
                "ec2",
                "s3",
                "sqs",
                "iam",
                "pricing",
                "dynamodb",
                "servicequotas",
            ), action
            assert "*" not in verb, f"{action}: name each action fleetd calls (no wildcards)"


def test_extractor_finds_the_calls_we_know_about():
    """Guards against a vacuous pass: the extractor must see the adapters' known calls."""
    controller = all_calls(controller_files())
    node = all_calls(node_files())
    for action in (
        "ec2:CreateFleet",
        "ec2:TerminateInstances",
        "ec2:DescribeInstances",
        "ec2:DescribeSpotPriceHistory",
        "sqs:ReceiveMessage",
    ):
        assert action in controller, (action, sorted(controller))
    for action in ("s3:PutObject", "s3:GetObject", "s3:CompleteMultipartUpload", "s3:ListObjectsV2"):
        assert action in node, (action, sorted(node))


def test_every_controller_call_is_allowed_by_the_controller_policy():
    policy = load("controller-policy.json")
    missing = {
        needed: where
        for action, where in all_calls(controller_files()).items()
        for needed in iam_actions(action)
        if needed not in NOT_GRANTED_ON_PURPOSE and not allowed(policy, needed)
    }
    assert not missing, f"controller-policy.json lacks: {missing}"


def test_every_node_call_is_allowed_on_the_checkpoint_prefix_only():
    policy = load("node-policy.json")
    cfg, job = CheckpointConfig(), JobConfig()
    layout = CheckpointLayout(cfg.prefix, job.name)
    bucket_arn = f"arn:aws:s3:::{cfg.bucket}"
    object_arn = f"{bucket_arn}/{layout.manifest_key(7)}"
    list_context = {"s3:prefix": [layout.job_prefix]}
    calls = all_calls(node_files())
    assert not [a for a in calls if not a.startswith("s3:")], "nodes call only S3"
    problems = []
    for action, where in calls.items():
        for needed in iam_actions(action):
            if needed in NOT_GRANTED_ON_PURPOSE:
                continue
            resource = bucket_arn if needed in BUCKET_ACTIONS else object_arn
            if not allowed(policy, needed, resource, list_context):
                problems.append((needed, where))
            if needed not in BUCKET_ACTIONS:
                # ... and the same action outside the prefix is not allowed.
                assert not allowed(policy, needed, f"{bucket_arn}/other-team/x", list_context), needed
                assert not allowed(policy, needed, f"arn:aws:s3:::another-bucket/{layout.manifest_key(7)}", {})
    assert not problems, f"node-policy.json lacks: {problems}"
    assert not allowed(policy, "s3:ListBucket", bucket_arn, {"s3:prefix": ["other-team/"]})
    assert not allowed(policy, "s3:ListBucket", bucket_arn, {})  # listing the whole bucket


def test_calls_left_ungranted_run_only_outside_production():
    for action in NOT_GRANTED_ON_PURPOSE:
        assert not allowed(load("node-policy.json"), action) and not allowed(load("controller-policy.json"), action)
    # ensure_bucket (the CreateBucket caller) is called only by its own wrapper and by the operator
    # tool behind an explicit --create-bucket (run with the operator's credentials, not a role).
    callers = [
        f"{p.relative_to(ROOT)}:{n.lineno}"
        for p in [*controller_files(), *node_files()]
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "ensure_bucket"
    ]
    allowed_callers = ("agent/checkpoint_store/store.py", "agent/checkpoint_store/__main__.py")
    assert all(c.startswith(allowed_callers) for c in callers), callers


def test_launches_are_allowed_only_with_the_fleet_tag_and_terminations_only_of_tagged_instances():
    policy = load("controller-policy.json")
    tag = ec2_adapter.TAG_FLEET
    assert tag == "fleetd:fleet"
    instance = "arn:aws:ec2:us-east-1:123456789012:instance/i-0123456789abcdef0"
    tagged_request = {f"aws:RequestTag/{tag}": ["prod"], "aws:TagKeys": [tag]}
    assert allowed(policy, "ec2:RunInstances", instance, tagged_request)
    assert allowed(policy, "ec2:CreateFleet", "arn:aws:ec2:us-east-1:123456789012:fleet/fleet-1", tagged_request)
    assert not allowed(policy, "ec2:RunInstances", instance, {})
    assert allowed(policy, "ec2:TerminateInstances", instance, {f"aws:ResourceTag/{tag}": ["prod"]})
    assert not allowed(policy, "ec2:TerminateInstances", instance, {"aws:ResourceTag/Name": ["db"]})
    # Tags: while creating, or the pool tag on fleet instances; never retagging foreign instances.
    assert allowed(policy, "ec2:CreateTags", instance, {"ec2:CreateAction": ["CreateFleet"]})
    assert allowed(
        policy, "ec2:CreateTags", instance, {f"aws:ResourceTag/{tag}": ["prod"], "aws:TagKeys": [ec2_adapter.TAG_POOL]}
    )
    assert not allowed(policy, "ec2:CreateTags", instance, {"aws:TagKeys": [tag]})
    assert not allowed(policy, "ec2:CreateTags", instance, {f"aws:ResourceTag/{tag}": ["prod"], "aws:TagKeys": [tag]})
    node_role = "arn:aws:iam::123456789012:role/fleetd-node"
    assert allowed(policy, "iam:PassRole", node_role, {"iam:PassedToService": ["ec2.amazonaws.com"]})
    assert not allowed(
        policy, "iam:PassRole", "arn:aws:iam::123456789012:role/admin", {"iam:PassedToService": ["ec2.amazonaws.com"]}
    )
    assert not allowed(policy, "iam:PassRole", node_role, {"iam:PassedToService": ["lambda.amazonaws.com"]})


def test_the_adapters_create_fleet_request_tags_what_the_policy_requires():
    """CreateFleet with the adapter's real request: every resource it tags at creation carries the
    fleet tag, which is what LaunchOnlyFleetTaggedInstances demands."""
    from fleetd.adapters.launch_template import TemplateRef
    from fleetd.policy.model import Market, PoolId

    api = ec2_adapter.AioEc2(None, fleet="prod", job="train", template=TemplateRef("lt-1", "$Default"))
    spec = ec2_adapter.LaunchSpec(token="t", count=2, market=Market.SPOT, pools=(PoolId("g5.xlarge", "us-east-1a"),))
    request = api.create_fleet_request(spec)
    policy = load("controller-policy.json")
    for ts in request["TagSpecifications"]:
        tags = {t["Key"]: t["Value"] for t in ts["Tags"]}
        assert tags[ec2_adapter.TAG_FLEET] == "prod"
        context = {f"aws:RequestTag/{k}": [v] for k, v in tags.items()} | {"aws:TagKeys": list(tags)}
        resource = f"arn:aws:ec2:us-east-1:123456789012:{ts['ResourceType']}/x-1"
        assert allowed(policy, "ec2:CreateFleet", resource, context), ts["ResourceType"]
        assert allowed(policy, "ec2:CreateTags", resource, {"ec2:CreateAction": ["CreateFleet"]})


def test_node_enrolment_needs_no_new_grant_and_nodes_no_ec2_at_all():
    """Enrolment (fleetd/identity) asks EC2 one thing, through the production adapter:
    DescribeInstances filtered by the fleet tag (AioEc2.fleet_instance_state). Describe calls have
    no resource-level permissions, hence the Describe calls fleetd makes, named, on "*". The node side proves itself with
    the identity document from IMDS: no AWS call, so the node policy stays S3-only."""
    import inspect

    from fleetd.identity import server as enrol_server

    assert "fleet_instance_state" in inspect.getsource(enrol_server)
    src = inspect.getsource(ec2_adapter.AioEc2.fleet_instance_state)
    assert "_describe" in src and "TAG_FLEET" in src
    assert allowed(load("controller-policy.json"), "ec2:DescribeInstances")
    identity_files = sorted((ROOT / "fleetd" / "identity").rglob("*.py"))
    assert identity_files and all(p in controller_files() for p in identity_files)
    assert not all_calls([ROOT / "agent" / "node" / "enrol.py"])
    assert not allowed(load("node-policy.json"), "ec2:DescribeInstances")


def test_the_ha_state_calls_are_allowed_on_the_state_table_only():
    """fleetd/ha/table.py's calls (lease, fenced writes, reads) on the fleetd-state table, and no
    other table; nothing of DynamoDB for the nodes."""
    policy = load("controller-policy.json")
    calls = all_calls([ROOT / "fleetd" / "ha" / "table.py"])
    for action in ("dynamodb:TransactWriteItems", "dynamodb:PutItem", "dynamodb:GetItem", "dynamodb:Query"):
        assert action in calls, sorted(calls)
    table = "arn:aws:dynamodb:us-east-1:123456789012:table/fleetd-state"
    other = "arn:aws:dynamodb:us-east-1:123456789012:table/someone-else"
    for action in calls:
        for needed in iam_actions(action):
            if needed in NOT_GRANTED_ON_PURPOSE:
                continue
            assert allowed(policy, needed, table), needed
            assert not allowed(policy, needed, other), needed
    assert not allowed(load("node-policy.json"), "dynamodb:PutItem")


def test_the_state_backup_is_the_controllers_alone():
    """fleetd/state_backup.py keeps the state DB (the spend so far) in the checkpoint bucket, but
    outside the prefix the nodes may write: a node cannot plant the state a controller restores."""
    from fleetd.config import FleetdConfig
    from fleetd.state_backup import backup_key

    cfg = FleetdConfig()
    key = f"arn:aws:s3:::{cfg.checkpoints.bucket}/{backup_key(cfg)}"
    for action in ("s3:GetObject", "s3:PutObject"):
        assert allowed(load("controller-policy.json"), action, key), action
        assert not allowed(load("node-policy.json"), action, key), action


def test_create_fleet_can_make_its_spot_requests():
    """CreateFleet cannot tag the spot-instances-request it makes (its TagSpecifications name the
    fleet, instances and volumes): under a request-tag condition every spot launch was denied."""
    policy = load("controller-policy.json")
    request = "arn:aws:ec2:us-east-1:123456789012:spot-instances-request/sir-abc123"
    assert allowed(policy, "ec2:CreateFleet", request, {})
    assert allowed(policy, "ec2:RunInstances", request, {})
    # The instance it starts still needs the fleet tag.
    instance = "arn:aws:ec2:us-east-1:123456789012:instance/i-0123456789abcdef0"
    assert not allowed(policy, "ec2:CreateFleet", instance, {})


def test_a_missing_state_backup_reads_as_not_found():
    """Without s3:ListBucket, S3 answers a missing key with 403, not 404: a fresh fleet's restore
    of its state logged an access error at every first start."""
    from fleetd.config import FleetdConfig
    from fleetd.state_backup import backup_key

    cfg = FleetdConfig()
    bucket = f"arn:aws:s3:::{cfg.checkpoints.bucket}"
    prefix = backup_key(cfg)
    assert allowed(load("controller-policy.json"), "s3:ListBucket", bucket, {"s3:prefix": [prefix]})
    # The job's prefix too, since a team's region move copies its checkpoint (fleetd/team/region_move.py);
    # nothing outside the two.
    assert allowed(load("controller-policy.json"), "s3:ListBucket", bucket, {"s3:prefix": ["checkpoints/train/"]})
    assert not allowed(load("controller-policy.json"), "s3:ListBucket", bucket, {"s3:prefix": ["other/"]})
