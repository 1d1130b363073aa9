"""deploy/iam checked by parliament (duo-labs' IAM linter: malformed policies, unknown actions,
resources of the wrong type, `*` where the action takes a resource, risky conditions), as CI runs it.

Every finding fails the test except one kind, each instance of which is proved harmless here:
EC2 authorises RunInstances and CreateFleet per resource type they touch, and the controller
policy splits those types in two statements (the instance and the fleet only with the fleet's tag;
the image, subnet, security group and the like as they exist), so parliament flags each statement
for the types the other one grants. The test checks that the other statement does grant them.

parliament 1.6.4 imports ``pkg_resources`` for one function (resource_filename), which setuptools
no longer ships (>= 81): the shim below gives it that function, nothing else."""

from __future__ import annotations

import fnmatch
import importlib.resources
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

IAM = Path(__file__).resolve().parent.parent / "deploy" / "iam"


def _parliament() -> Any:
    if "pkg_resources" not in sys.modules:
        shim = types.ModuleType("pkg_resources")
        shim.resource_filename = lambda package, name: str(importlib.resources.files(package) / name)  # type: ignore[attr-defined]
        sys.modules["pkg_resources"] = shim
    import parliament

    return parliament


def _findings(text: str, path: Path) -> list[Any]:
    p = _parliament()
    policy = p.analyze_policy_string(text, filepath=str(path))
    return [p.enhance_finding(f) for f in policy.findings]


def _granted_elsewhere(policy: dict, action: str, resource_format: str, line: int, text: str) -> bool:
    """Another Allow statement (not the one at ``line``) grants ``action`` on resources of that type."""
    kind = resource_format.split(":")[-1]  # e.g. "image/*", "subnet/*"
    for st in policy["Statement"]:
        start = text.index(f'"Sid": "{st["Sid"]}"')
        if text.count("\n", 0, start) + 1 in range(line, line + 3):
            continue  # the flagged statement itself (parliament points at its opening brace)
        actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
        resources = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
        if (
            st["Effect"] == "Allow"
            and action in actions
            and any(fnmatch.fnmatch(kind, r.split(":")[-1]) for r in resources)
        ):
            return True
    return False


@pytest.mark.parametrize("name", ["controller-policy.json", "node-policy.json"])
def test_parliament_finds_nothing_left_to_fix(name: str) -> None:
    path = IAM / name
    text = path.read_text()
    policy = json.loads(text)
    unexplained = []
    for f in _findings(text, path):
        if f.issue == "RESOURCE_MISMATCH" and all(
            _granted_elsewhere(policy, d["action"], d["required_format"], f.location["line"], text) for d in f.detail
        ):
            continue
        unexplained.append((f.issue, f.severity, f.detail, f.location))
    assert not unexplained, unexplained


def test_parliament_would_catch_a_broken_policy(tmp_path: Path) -> None:
    """Not a vacuous pass: a typo'd action, `*` where a resource is required, and a launch grant
    whose other half is missing are each reported."""
    policy = json.loads((IAM / "controller-policy.json").read_text())
    policy["Statement"] = [s for s in policy["Statement"] if s["Sid"] != "LaunchUsingExistingResources"]
    policy["Statement"] += [
        {"Sid": "Typo", "Effect": "Allow", "Action": ["s3:GetObjekt"], "Resource": "arn:aws:s3:::b/*"},
        {"Sid": "Star", "Effect": "Allow", "Action": ["s3:GetObject"], "Resource": "*"},
    ]
    text = json.dumps(policy, indent=2)
    issues = {f.issue for f in _findings(text, tmp_path / "broken.json")}
    assert {"UNKNOWN_ACTION", "RESOURCE_STAR"} <= issues, issues
    unexplained = [
        f
        for f in _findings(text, tmp_path / "broken.json")
        if f.issue == "RESOURCE_MISMATCH"
        and not all(
            _granted_elsewhere(policy, d["action"], d["required_format"], f.location["line"], text) for d in f.detail
        )
    ]
    assert unexplained, "the launch statement's missing image/subnet grant went unnoticed"
