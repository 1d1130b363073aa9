"""`fleetd iam render`: deploy/iam's policies with a fleet's own bucket, prefix, queue, table and
node role. A rendered policy still allows every call the code makes, on that fleet's names only,
and parliament finds nothing in it that it does not find in the shipped one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fleetd.commands.iam import Names, render
from fleetd.protocol.checkpoints import CheckpointLayout
from tests.test_iam_parliament import _findings
from tests.test_iam_policies import BUCKET_ACTIONS, NOT_GRANTED_ON_PURPOSE, all_calls, allowed, iam_actions, node_files

ROOT = Path(__file__).resolve().parent.parent
IAM = ROOT / "deploy" / "iam"
FLEETD = Path(sys.executable).parent / "fleetd"
CONFIG = """
[checkpoints]
bucket = "acme-ml-ckpt"
prefix = "runs/team-a"

[events]
sqs_queue_url = "https://sqs.eu-west-1.amazonaws.com/123456789012/acme-spot-events"

[ha]
table = "acme-fleetd"
"""


def _rendered(name: str, tmp_path: Path) -> dict:
    cfg = tmp_path / "fleetd.toml"
    cfg.write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETD_")}
    out = subprocess.run(
        [str(FLEETD), "iam", "render", str(IAM / name), "--config", str(cfg), "--node-role", "acme-node"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_rendered_policies_name_only_this_fleets_resources(tmp_path: Path) -> None:
    controller = json.dumps(_rendered("controller-policy.json", tmp_path))
    node = json.dumps(_rendered("node-policy.json", tmp_path))
    for text in (controller, node):
        assert "fleetd-checkpoints" not in text and '"checkpoints/*"' not in text
        assert "arn:aws:s3:::acme-ml-ckpt" in text
    assert "arn:aws:sqs:*:*:acme-spot-events" in controller and "table/acme-fleetd" in controller
    assert "role/acme-node" in controller and "role/fleetd-node" not in controller
    assert "arn:aws:s3:::acme-ml-ckpt/runs/team-a/*/code/*" in controller
    assert "arn:aws:s3:::acme-ml-ckpt/_fleetd-state/*" in controller  # the backup lives beside, not under


def test_every_node_call_is_allowed_on_the_rendered_prefix_and_nowhere_else(tmp_path: Path) -> None:
    policy = _rendered("node-policy.json", tmp_path)
    layout = CheckpointLayout("runs/team-a", "train")
    bucket_arn = "arn:aws:s3:::acme-ml-ckpt"
    object_arn = f"{bucket_arn}/{layout.manifest_key(7)}"
    context = {"s3:prefix": [layout.job_prefix]}
    for action in all_calls(node_files()):
        for needed in iam_actions(action):
            if needed in NOT_GRANTED_ON_PURPOSE:
                continue
            resource = bucket_arn if needed in BUCKET_ACTIONS else object_arn
            assert allowed(policy, needed, resource, context), needed
            if needed not in BUCKET_ACTIONS:
                assert not allowed(policy, needed, f"{bucket_arn}/checkpoints/train/x", context), needed
                assert not allowed(policy, needed, f"arn:aws:s3:::fleetd-checkpoints/{layout.manifest_key(7)}", {})
    assert not allowed(policy, "s3:ListBucket", bucket_arn, {"s3:prefix": ["checkpoints/"]})


def test_parliament_finds_the_same_in_a_rendered_policy(tmp_path: Path) -> None:
    names = Names(bucket="acme-ml-ckpt", prefix="runs/team-a", queue="q", table="t", node_role="r")
    for name in ("controller-policy.json", "node-policy.json"):
        shipped = json.loads((IAM / name).read_text())
        ours = json.dumps(render(shipped, names), indent=2)
        before = sorted(f.issue for f in _findings((IAM / name).read_text(), IAM / name))
        after = sorted(f.issue for f in _findings(ours, tmp_path / name))
        assert after == before, (name, before, after)
        assert render(shipped, names) != shipped and json.loads((IAM / name).read_text()) == shipped
