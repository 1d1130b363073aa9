"""deploy/cloudformation/ha-state.yaml: lints clean, and the table it creates is the one
fleetd's HA backend uses (keys, a lease and a fenced write work on the deployed table)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import boto3

from fleetd.ha.table import DynamoTable
from fleetd.policy.lease import LeaseRecord
from fleetd.reconcile.state_dynamo import DynamoStateStore
from tests.ha_support import PinnedFence
from tests.harness.moto import NO_RETRIES

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "deploy" / "cloudformation" / "ha-state.yaml"


def test_cfn_lint_is_clean() -> None:
    cfn_lint = Path(sys.executable).parent / "cfn-lint"
    out = subprocess.run([str(cfn_lint), str(TEMPLATE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


async def test_the_deployed_table_serves_the_lease_and_fenced_writes(moto_endpoint, aio_session) -> None:
    kwargs = {"endpoint_url": moto_endpoint, "region_name": "us-east-1", "config": NO_RETRIES}
    cfn = boto3.client("cloudformation", **kwargs)
    cfn.create_stack(StackName="fleetd-ha", TemplateBody=TEMPLATE.read_text())
    outputs = {
        o["OutputKey"]: o["OutputValue"] for o in cfn.describe_stacks(StackName="fleetd-ha")["Stacks"][0]["Outputs"]
    }
    assert outputs["TableName"] == "fleetd-state"
    async with aio_session.create_client("dynamodb", **kwargs) as client:
        table = DynamoTable(client, outputs["TableName"], "f1")
        assert await table.put_lease(LeaseRecord("host-a", 1, "v1"), None)
        store = DynamoStateStore(table, PinnedFence("host-a", 1))
        await store.set_meta("target_nodes", 3)
        assert await DynamoStateStore(table, PinnedFence("host-a", 1)).get_meta("target_nodes") == 3
