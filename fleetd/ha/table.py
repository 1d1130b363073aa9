"""The HA state's DynamoDB table (aiobotocore): one item per row, every write fenced.

Layout (one table may hold several fleets): partition key ``pk`` = ``<fleet>#<kind>`` (kind:
launch, inst, pool, meta, ledger, lease), sort key ``sk`` = the row's key (launch token,
instance id, pool, meta key, ledger sequence number), ``v`` = the row as JSON. The lease item
(``<fleet>#lease`` / ``lease``) carries ``holder``, ``gen`` and ``ver`` as attributes, because
conditions test them.

A fenced write is one TransactWriteItems: a ConditionCheck that the lease item still has the
writer's holder and generation, plus up to 99 puts. A paused leader that wakes after another host
took over gets ConditionalCheckFailed on that check, so nothing it writes lands. Writes of more
than 99 rows are split into several transactions, each fenced (not atomic together: see DESIGN).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any, Protocol

from botocore.exceptions import BotoCoreError, ClientError

from fleetd.adapters.aws_errors import AwsError, aws_call, translate
from fleetd.ha.errors import LeaseLost
from fleetd.policy.lease import LeaseRecord
from fleetd.shared.failpoints import failpoint
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

LEASE = "lease"
MAX_PUTS = 99  # TransactWriteItems takes 100 actions; one is the fence


class Fence(Protocol):
    """The writer's lease (fleetd.ha.election.Election)."""

    holder: str

    def generation(self) -> int:
        """The generation this process leads at; raises LeaseLost when it does not lead now."""
        ...

    def refused(self, what: str) -> None:
        """A fenced write was refused by the store: give the lease up (raises LeaseLost)."""
        ...


def _fence_refused(exc: BaseException) -> bool:
    reasons = exc.response.get("CancellationReasons") or [] if isinstance(exc, ClientError) else []
    return bool(reasons) and reasons[0].get("Code") == "ConditionalCheckFailed"


def _log_late_answer(call: asyncio.Future[Any], generation: int, rows: int) -> None:
    """The answer to a write whose caller was cancelled meanwhile (the lease was lost)."""
    if call.cancelled():
        return
    exc = call.exception()
    if exc is None:
        log.info(
            "fenced_write_landed",
            generation=generation,
            rows=rows,
            why="sent while this host still held the lease; its caller has stopped since",
        )
    elif _fence_refused(exc):
        log.warning(
            "fenced_write_refused",
            generation=generation,
            rows=rows,
            why="the lease item no longer names this host at this generation",
        )
    else:
        log.warning("fenced_write_failed", generation=generation, rows=rows, error=str(exc))


class DynamoTable:
    def __init__(self, client: Any, name: str, fleet: str):
        self.client, self.name, self.fleet = client, name, fleet

    def pk(self, kind: str) -> str:
        return f"{self.fleet}#{kind}"

    async def ensure(self) -> None:
        """Create the table when it is missing (tests and single-account trials; production
        creates it from deploy/cloudformation/ha-state.yaml and grants no CreateTable)."""
        try:
            async with aws_call("DescribeTable"):
                await self.client.describe_table(TableName=self.name)
            return
        except AwsError as exc:
            if exc.code != "ResourceNotFoundException":
                raise
        async with aws_call("CreateTable"):
            await self.client.create_table(
                TableName=self.name,
                BillingMode="PAY_PER_REQUEST",
                KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}, {"AttributeName": "sk", "KeyType": "RANGE"}],
                AttributeDefinitions=[
                    {"AttributeName": "pk", "AttributeType": "S"},
                    {"AttributeName": "sk", "AttributeType": "S"},
                ],
            )
            waiter = self.client.get_waiter("table_exists")
            await waiter.wait(TableName=self.name, WaiterConfig={"Delay": 1, "MaxAttempts": 60})

    # -- rows -------------------------------------------------------------------------------------
    async def query(self, kind: str) -> dict[str, Any]:
        """Every row of one kind: sort key -> decoded value (strongly consistent reads)."""
        out: dict[str, Any] = {}
        kwargs: dict[str, Any] = dict(
            TableName=self.name,
            ConsistentRead=True,
            KeyConditionExpression="pk = :p",
            ExpressionAttributeValues={":p": {"S": self.pk(kind)}},
        )
        while True:
            async with aws_call("Query"):
                page = await self.client.query(**kwargs)
            for item in page.get("Items", []):
                out[item["sk"]["S"]] = json.loads(item["v"]["S"])
            if "LastEvaluatedKey" not in page:
                return out
            kwargs["ExclusiveStartKey"] = page["LastEvaluatedKey"]

    async def write(self, rows: Sequence[tuple[str, str, Any]], fence: Fence) -> None:
        """Put (kind, key, value) rows, fenced by the writer's lease generation."""
        for start in range(0, len(rows), MAX_PUTS):
            generation = fence.generation()  # raises LeaseLost before sending when the lease lapsed locally
            # The HA tests pause (SIGSTOP) a leader here, after its own lease check and before
            # the store sees its write: it wakes after another host took over, and is refused.
            failpoint("fenced-write")
            check = {
                "ConditionCheck": {
                    "TableName": self.name,
                    "Key": self._lease_key(),
                    "ConditionExpression": "holder = :h AND gen = :g",
                    "ExpressionAttributeValues": {":h": {"S": fence.holder}, ":g": {"N": str(generation)}},
                }
            }
            puts = [
                {
                    "Put": {
                        "TableName": self.name,
                        "Item": {
                            "pk": {"S": self.pk(kind)},
                            "sk": {"S": key},
                            "v": {"S": json.dumps(value, sort_keys=True)},
                        },
                    }
                }
                for kind, key, value in rows[start : start + MAX_PUTS]
            ]
            call = asyncio.ensure_future(self.client.transact_write_items(TransactItems=[check, *puts]))
            try:
                # Shielded: a write on the wire cannot be called back by cancelling this side (the
                # store may still apply it), so its answer is always waited for and logged.
                await asyncio.shield(call)
            except asyncio.CancelledError:
                n_puts = len(puts)
                call.add_done_callback(lambda f, g=generation, n=n_puts: _log_late_answer(f, g, n))
                raise
            except ClientError as exc:
                if _fence_refused(exc):
                    log.warning(
                        "fenced_write_refused",
                        generation=generation,
                        rows=len(puts),
                        why="the lease item no longer names this host at this generation",
                    )
                    fence.refused("a fenced write was refused")
                    raise LeaseLost("fenced write refused") from None
                raise translate(exc, "TransactWriteItems") from exc
            except BotoCoreError as exc:
                raise translate(exc, "TransactWriteItems") from exc

    # -- the lease item ---------------------------------------------------------------------------
    def _lease_key(self) -> dict[str, Any]:
        return {"pk": {"S": self.pk(LEASE)}, "sk": {"S": LEASE}}

    async def get_lease(self) -> LeaseRecord | None:
        async with aws_call("GetItem"):
            resp = await self.client.get_item(TableName=self.name, Key=self._lease_key(), ConsistentRead=True)
        item = resp.get("Item")
        if item is None:
            return None
        return LeaseRecord(item["holder"]["S"], int(item["gen"]["N"]), item["ver"]["S"])

    async def put_lease(self, write: LeaseRecord, expect: LeaseRecord | None) -> bool:
        """Conditional put: True when the store still held ``expect`` (None: no item) and now holds ``write``."""
        if expect is None:
            cond: dict[str, Any] = {"ConditionExpression": "attribute_not_exists(pk)"}
        else:
            cond = {
                "ConditionExpression": "holder = :h AND gen = :g AND ver = :v",
                "ExpressionAttributeValues": {
                    ":h": {"S": expect.holder},
                    ":g": {"N": str(expect.generation)},
                    ":v": {"S": expect.version},
                },
            }
        item = {
            **self._lease_key(),
            "holder": {"S": write.holder},
            "gen": {"N": str(write.generation)},
            "ver": {"S": write.version},
        }
        try:
            await self.client.put_item(TableName=self.name, Item=item, **cond)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "ConditionalCheckFailedException":
                return False
            raise translate(exc, "PutItem") from exc
        except BotoCoreError as exc:
            raise translate(exc, "PutItem") from exc
        return True
