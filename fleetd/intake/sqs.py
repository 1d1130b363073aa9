"""EventBridge → SQS intake: the controller's second, independent view of spot events.

This consumer long-polls its fleet's own queue, turns the three EC2 event types into the internal
events the MQTT intake produces (``InterruptionNotice``, ``RebalanceRecommended``) plus
``InstanceStateChanged``, and deletes each message once handled (a repeat is dropped by the
registry). An event about an unknown instance goes back to the queue until it is older than
``unknown_instance_grace_s``; a malformed body is logged once and deleted.
(docs/DESIGN.md "Several fleets in one account")
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from tenacity import RetryCallState

from fleetd.adapters.aws_errors import AwsError, aws_call
from fleetd.intake.events import (
    EventCommon,
    InstanceStateChanged,
    IntakeEvent,
    InterruptionNotice,
    RebalanceRecommended,
)
from fleetd.intake.registry import NodeRegistry
from fleetd.protocol.errors import ProtocolError
from fleetd.shared.backoff import failure_of, retrying
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

SPOT_WARNING = "EC2 Spot Instance Interruption Warning"
REBALANCE = "EC2 Instance Rebalance Recommendation"
STATE_CHANGE = "EC2 Instance State-change Notification"
DETAIL_TYPES = (SPOT_WARNING, REBALANCE, STATE_CHANGE)
# AWS gives two minutes between the warning and the action; the event carries only its own time.
SPOT_WARNING_LEAD_S = 120.0
EC2_STATES = frozenset({"pending", "running", "stopping", "stopped", "shutting-down", "terminated"})
_INSTANCE_ID = re.compile(r"^i-[0-9a-f]{8,32}$")
MAX_BODY_BYTES = 256 * 1024

# The EventBridge event pattern for the rule that feeds this intake.
EVENT_PATTERN: dict[str, Any] = {"source": ["aws.ec2"], "detail-type": list(DETAIL_TYPES)}


def _event_time(value: Any) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    raise ProtocolError(f"event time {str(value)[:40]!r} is not a timestamp")


def parse_event(body: str | bytes, received_at: float) -> IntakeEvent | None:
    """One SQS body (an EventBridge event) → an intake event; None for an EC2 event we do not use.

    Raises ProtocolError for anything that is not a well-formed event of a type we handle.
    """
    if len(body) > MAX_BODY_BYTES:
        raise ProtocolError(f"body of {len(body)} bytes is too large")
    try:
        event = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"body is not JSON: {exc}") from None
    if not isinstance(event, dict):
        raise ProtocolError("body is not a JSON object")
    detail_type = event.get("detail-type")
    detail = event.get("detail")
    event_id = event.get("id")
    if not isinstance(detail_type, str) or not isinstance(detail, dict) or not isinstance(event_id, str):
        raise ProtocolError("not an EventBridge event (need id, detail-type, detail)")
    if event.get("source") != "aws.ec2":
        raise ProtocolError(f"source {str(event.get('source'))[:60]!r} is not aws.ec2")
    if detail_type not in DETAIL_TYPES:
        return None
    instance_id = detail.get("instance-id")
    if not isinstance(instance_id, str) or not _INSTANCE_ID.match(instance_id):
        raise ProtocolError(f"detail.instance-id {str(instance_id)[:40]!r} is not an instance id")
    at = _event_time(event.get("time"))
    common: EventCommon = {
        "instance_id": instance_id,
        "received_at": received_at,
        "dedup_key": f"eventbridge:{event_id}",
    }
    if detail_type == SPOT_WARNING:
        action = detail.get("instance-action")
        if action not in ("terminate", "stop", "hibernate"):
            raise ProtocolError(f"detail.instance-action {str(action)[:40]!r} is unknown")
        return InterruptionNotice(action=action, action_time=at + SPOT_WARNING_LEAD_S, source="eventbridge", **common)
    if detail_type == REBALANCE:
        return RebalanceRecommended(notice_time=at, source="eventbridge", **common)
    state = detail.get("state")
    if state not in EC2_STATES:
        raise ProtocolError(f"detail.state {str(state)[:40]!r} is not an EC2 state")
    return InstanceStateChanged(state=state, **common)


class SqsIntake:
    """Long-polls one queue with an aiobotocore SQS client; ``run()`` until cancelled."""

    def __init__(
        self,
        sqs: Any,
        queue_url: str,
        registry: NodeRegistry,
        *,
        wait_s: int = 20,
        is_ours: Callable[[str], bool] | None = None,
        backoff_max_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        unknown_grace_s: float = 180.0,
        unknown_retry_s: int = 10,
    ) -> None:
        self.sqs = sqs
        self.queue_url = queue_url
        self.registry = registry
        self.wait_s = wait_s
        self.is_ours = is_ours or registry.is_known
        self.backoff_max_s = backoff_max_s
        self.clock = clock
        self.unknown_grace_s = unknown_grace_s
        self.unknown_retry_s = unknown_retry_s
        self.handled = 0
        self.rejected = 0
        self.not_ours = 0  # dropped: unknown for longer than the grace
        self.deferred = 0  # put back: unknown for now

    async def run(self) -> None:
        def failed(state: RetryCallState) -> None:
            log.warning("intake_sqs_failed", error=str(failure_of(state)), retry_in_s=state.upcoming_sleep)

        while True:  # one long poll after another; a failed one is retried, then the schedule starts over
            async for attempt in retrying(1.0, self.backoff_max_s, retry_on=AwsError, before_sleep=failed):
                with attempt:
                    await self.poll_once()

    async def poll_once(self) -> list[IntakeEvent]:
        """One long poll; returns the events applied (duplicates and foreign events excluded)."""
        async with aws_call("ReceiveMessage"):
            resp = await self.sqs.receive_message(
                QueueUrl=self.queue_url,
                MaxNumberOfMessages=10,
                WaitTimeSeconds=self.wait_s,
                AttributeNames=["SentTimestamp"],
            )
        messages = resp.get("Messages", [])
        applied: list[IntakeEvent] = []
        done: list[dict[str, str]] = []
        later: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            event, keep = self._handle(message)
            if event is not None:
                applied.append(event)
            if keep:
                later.append(
                    {"Id": str(i), "ReceiptHandle": message["ReceiptHandle"], "VisibilityTimeout": self.unknown_retry_s}
                )
            else:
                done.append({"Id": str(i), "ReceiptHandle": message["ReceiptHandle"]})
        if later:
            async with aws_call("ChangeMessageVisibilityBatch"):
                resp = await self.sqs.change_message_visibility_batch(QueueUrl=self.queue_url, Entries=later)
            for failed in resp.get("Failed", []):
                # It comes back after the queue's own visibility timeout instead: only later.
                log.warning("intake_sqs_defer_failed", code=failed.get("Code"), message=failed.get("Message"))
        if done:
            async with aws_call("DeleteMessageBatch"):
                resp = await self.sqs.delete_message_batch(QueueUrl=self.queue_url, Entries=done)
            for failed in resp.get("Failed", []):
                # It will come back after the visibility timeout; the registry drops the repeat.
                log.warning("intake_sqs_delete_failed", code=failed.get("Code"), message=failed.get("Message"))
        return applied

    def _handle(self, message: dict[str, Any]) -> tuple[IntakeEvent | None, bool]:
        """(the event applied or None, whether to put the message back instead of deleting it)."""
        body = message.get("Body", "")
        now = self.clock()
        try:
            event = parse_event(body, now)
        except ProtocolError as exc:
            self.rejected += 1  # deleted, so a poison message cannot come back forever
            log.warning(
                "intake_sqs_rejected", message_id=message.get("MessageId"), reason=str(exc)[:300], nbytes=len(body)
            )
            return None, False
        if event is None:
            return None, False
        if not self.is_ours(event.instance_id):
            # Perhaps launched seconds ago (tracked at the next pass), or the controller just
            # restarted with an empty registry. Past the grace: another fleet's node.
            age = _age_s(message, now)
            if age is not None and age < self.unknown_grace_s:
                self.deferred += 1
                log.info(
                    "intake_sqs_unknown_deferred",
                    instance_id=event.instance_id,
                    type=type(event).__name__,
                    age_s=round(age, 1),
                    retry_in_s=self.unknown_retry_s,
                )
                return None, True
            self.not_ours += 1
            log.info("intake_sqs_not_ours", instance_id=event.instance_id, type=type(event).__name__)
            return None, False
        if not self.registry.apply(event):
            return None, False
        self.handled += 1
        log.info("intake_sqs_event", instance_id=event.instance_id, type=type(event).__name__)
        return event, False


def _age_s(message: dict[str, Any], now: float) -> float | None:
    """Seconds since SQS accepted the message (None when SQS did not say)."""
    sent = message.get("Attributes", {}).get("SentTimestamp")
    try:
        return max(0.0, now - int(sent) / 1000.0)
    except (TypeError, ValueError):
        return None


async def run(
    aws: Any,
    queue_url: str,
    registry: NodeRegistry,
    *,
    wait_s: int = 20,
    unknown_grace_s: float = 180.0,
    unknown_retry_s: int = 10,
) -> None:
    """TaskGroup component for fleetd's daemon: consume ``queue_url`` until cancelled.

    ``aws`` is the AwsConfig (region, endpoint_url, profile).
    """
    from aiobotocore.session import AioSession

    session = AioSession(profile=aws.profile) if aws.profile else AioSession()
    async with session.create_client("sqs", region_name=aws.region, endpoint_url=aws.endpoint_url) as sqs:
        await SqsIntake(
            sqs, queue_url, registry, wait_s=wait_s, unknown_grace_s=unknown_grace_s, unknown_retry_s=unknown_retry_s
        ).run()
