"""`fleetd iam render FILE [--config F]`: one of deploy/iam's policies with this fleet's names in
place of the examples it is written with: the checkpoint bucket and prefix (S3 objects, the
ListBucket prefix conditions), the event queue, the HA state table, the node role. Attach what it
prints (deploy/README.md, "IAM"); tests/test_iam_render.py checks every call the code makes is
still allowed by a rendered policy, and parliament finds nothing new in it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fleetd.commands.common import add_config_argument
from fleetd.config import DEFAULT_PATH

# The names deploy/iam/*.json are written with (the config's defaults).
EXAMPLE_BUCKET = "fleetd-checkpoints"
EXAMPLE_PREFIX = "checkpoints"
EXAMPLE_QUEUE = "fleetd-events"
EXAMPLE_TABLE = "fleetd-state"
EXAMPLE_NODE_ROLE = "fleetd-node"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="iam_command", metavar="ACTION", required=True)
    render = sub.add_parser(
        "render", help="print a deploy/iam policy with this fleet's bucket, prefix, queue and table"
    )
    render.add_argument("file", type=Path, metavar="FILE", help="deploy/iam/controller-policy.json or node-policy.json")
    add_config_argument(render, DEFAULT_PATH)
    render.add_argument(
        "--node-role", default=EXAMPLE_NODE_ROLE, help=f"the nodes' IAM role name (default: {EXAMPLE_NODE_ROLE})"
    )


def run(args: argparse.Namespace) -> int:
    from fleetd.commands.common import load_config

    cfg = load_config(args.config if args.config != DEFAULT_PATH or DEFAULT_PATH.exists() else None, "iam")
    if cfg is None:
        return 2
    try:
        policy = json.loads(args.file.read_text())
    except (OSError, ValueError) as exc:
        print(f"fleetd iam render: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    names = Names(
        bucket=cfg.checkpoints.bucket,
        prefix=cfg.checkpoints.prefix.strip("/"),
        queue=(cfg.events.sqs_queue_url or "").rstrip("/").rsplit("/", 1)[-1] or EXAMPLE_QUEUE,
        table=cfg.ha.table,
        node_role=args.node_role,
    )
    print(json.dumps(render(policy, names), indent=2))
    return 0


class Names:
    def __init__(self, *, bucket: str, prefix: str, queue: str, table: str, node_role: str) -> None:
        self.bucket, self.prefix, self.queue, self.table, self.node_role = bucket, prefix, queue, table, node_role


def render(policy: Any, n: Names) -> Any:
    """The policy with each example name replaced (pure: a new structure, the input untouched)."""
    if isinstance(policy, dict):
        return {k: render(v, n) for k, v in policy.items()}
    if isinstance(policy, list):
        return [render(v, n) for v in policy]
    if not isinstance(policy, str):
        return policy
    s = policy
    if s in (EXAMPLE_PREFIX, f"{EXAMPLE_PREFIX}/*"):  # an s3:prefix condition value
        return s.replace(EXAMPLE_PREFIX, n.prefix, 1)
    bucket_arn = f"arn:aws:s3:::{EXAMPLE_BUCKET}"
    if s.startswith(bucket_arn):
        rest = s[len(bucket_arn) :]
        if rest.startswith(f"/{EXAMPLE_PREFIX}/"):
            rest = f"/{n.prefix}/" + rest[len(EXAMPLE_PREFIX) + 2 :]
        return f"arn:aws:s3:::{n.bucket}{rest}"
    if s.endswith(f":{EXAMPLE_QUEUE}") and s.startswith("arn:aws:sqs:"):
        return s[: -len(EXAMPLE_QUEUE)] + n.queue
    if s.endswith(f":table/{EXAMPLE_TABLE}") and s.startswith("arn:aws:dynamodb:"):
        return s[: -len(EXAMPLE_TABLE)] + n.table
    if s.endswith(f":role/{EXAMPLE_NODE_ROLE}") and s.startswith("arn:aws:iam::"):
        return s[: -len(EXAMPLE_NODE_ROLE)] + n.node_role
    return s
