"""EventBridge → SQS intake against moto server: a real rule with an SQS target delivers the three
EC2 event types; the consumer turns them into the same internal events as the MQTT notices."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import pytest
from structlog.testing import capture_logs

from fleetd.intake.events import InstanceStateChanged, InterruptionNotice, RebalanceRecommended, from_message
from fleetd.intake.registry import NodeRegistry
from fleetd.intake.sqs import EVENT_PATTERN, REBALANCE, SPOT_WARNING, STATE_CHANGE, SqsIntake, parse_event
from fleetd.protocol.errors import ProtocolError
from fleetd.protocol.messages import Notice, Rebalance

OURS = "i-0123456789abcdef0"
OTHER_FLEET = "i-0fffffffffffffff1"
EVENT_TIME = datetime(2026, 11, 21, 6, 0, 0, tzinfo=UTC)


@pytest.fixture
async def eventbridge_queue(aio_session, aws_client_kwargs):
    """An SQS queue fed by an EventBridge rule (source aws.ec2, our three detail types)."""
    async with (
        aio_session.create_client("sqs", **aws_client_kwargs) as sqs,
        aio_session.create_client("events", **aws_client_kwargs) as events,
    ):
        queue_url = (await sqs.create_queue(QueueName="fleetd-events"))["QueueUrl"]
        arn = (await sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"]))["Attributes"][
            "QueueArn"
        ]
        await events.put_rule(Name="fleetd-ec2", EventPattern=json.dumps(EVENT_PATTERN), State="ENABLED")
        await events.put_targets(Rule="fleetd-ec2", Targets=[{"Id": "sqs", "Arn": arn}])
        yield sqs, events, queue_url


def ec2_event(detail_type: str, detail: dict) -> dict:
    return {
        "Source": "aws.ec2",
        "DetailType": detail_type,
        "Detail": json.dumps(detail),
        "Time": EVENT_TIME,
        "Resources": [f"arn:aws:ec2:us-east-1:123456789012:instance/{detail['instance-id']}"],
    }


async def drain(intake: SqsIntake, rounds: int = 3) -> list:
    out = []
    for _ in range(rounds):
        out += await intake.poll_once()
    return out


async def test_eventbridge_rule_delivers_three_types_as_internal_events(eventbridge_queue) -> None:
    sqs, events, queue_url = eventbridge_queue
    registry = NodeRegistry()
    registry.track(OURS)
    resp = await events.put_events(
        Entries=[
            ec2_event(SPOT_WARNING, {"instance-id": OURS, "instance-action": "terminate"}),
            ec2_event(REBALANCE, {"instance-id": OURS}),
            ec2_event(STATE_CHANGE, {"instance-id": OURS, "state": "shutting-down"}),
            # Another fleet's node on the same rule/queue, and an EC2 event type we do not match.
            ec2_event(SPOT_WARNING, {"instance-id": OTHER_FLEET, "instance-action": "terminate"}),
            {"Source": "aws.ec2", "DetailType": "EC2 AMI State Change", "Detail": json.dumps({"ImageId": "ami-1"})},
        ]
    )
    assert resp["FailedEntryCount"] == 0
    # Grace 0: an unknown instance's event is dropped at once (the deferral has its own tests).
    intake = SqsIntake(sqs, queue_url, registry, wait_s=1, unknown_grace_s=0)
    applied = await drain(intake)

    by_type = {type(e): e for e in applied}
    assert set(by_type) == {InterruptionNotice, RebalanceRecommended, InstanceStateChanged}
    assert intake.not_ours == 1 and intake.rejected == 0

    # The same internal event the MQTT intake makes of an agent's IMDS notice (source aside).
    t = EVENT_TIME.timestamp()
    mqtt_notice = from_message(
        Notice(
            instance_id=OURS, action="terminate", action_time=datetime.fromtimestamp(t + 120, UTC), source="eventbridge"
        ),
        time.time(),
    )
    assert by_type[InterruptionNotice] == mqtt_notice
    mqtt_rebalance = from_message(
        Rebalance(instance_id=OURS, notice_time=EVENT_TIME, source="eventbridge"), time.time()
    )
    assert by_type[RebalanceRecommended] == mqtt_rebalance
    assert by_type[InstanceStateChanged] == InstanceStateChanged(OURS, "shutting-down")

    rec = registry.record(OURS)
    assert rec is not None
    assert rec.notice_sources == {"eventbridge"} and rec.notice_deadline == t + 120
    assert rec.rebalance_at is not None and rec.ec2_state == "shutting-down"
    assert registry.record(OTHER_FLEET) is None

    # Every message was deleted after handling, the foreign and the unmatched ones included.
    left = await sqs.receive_message(QueueUrl=queue_url, WaitTimeSeconds=0)
    assert left.get("Messages", []) == []


async def test_duplicate_and_malformed_deliveries(eventbridge_queue) -> None:
    sqs, events, queue_url = eventbridge_queue
    registry = NodeRegistry()
    registry.track(OURS)
    await events.put_events(Entries=[ec2_event(SPOT_WARNING, {"instance-id": OURS, "instance-action": "stop"})])
    intake = SqsIntake(sqs, queue_url, registry, wait_s=1)
    first = await drain(intake, 1)
    assert len(first) == 1
    # At-least-once delivery: the same EventBridge event again (same id), plus poison messages.
    received_body = json.dumps(
        {
            "id": "dup-id",
            "source": "aws.ec2",
            "detail-type": SPOT_WARNING,
            "time": "2026-11-21T06:00:00Z",
            "detail": {"instance-id": OURS, "instance-action": "stop"},
        }
    )
    for body in (
        received_body,
        received_body,
        "not json",
        json.dumps([1, 2]),
        json.dumps(
            {
                "id": "x",
                "source": "aws.ec2",
                "detail-type": SPOT_WARNING,
                "time": "2026-11-21T06:00:00Z",
                "detail": {"instance-id": "../../etc"},
            }
        ),
    ):
        await sqs.send_message(QueueUrl=queue_url, MessageBody=body)
    with capture_logs() as logs:
        applied = await drain(intake)
    assert len(applied) == 1  # "dup-id" once; the repeat dropped by the registry
    assert registry.stats.duplicates == 1
    rejected = [e for e in logs if e["event"] == "intake_sqs_rejected"]
    assert len(rejected) == 3 == intake.rejected
    left = await sqs.receive_message(QueueUrl=queue_url, WaitTimeSeconds=0)
    assert left.get("Messages", []) == []


async def test_unreachable_sqs_is_retried_not_fatal(aio_session) -> None:
    from fleetd.adapters.aws_errors import AwsError
    from tests.harness.moto import NO_RETRIES

    async with aio_session.create_client(
        "sqs", endpoint_url="http://127.0.0.1:9", region_name="us-east-1", config=NO_RETRIES
    ) as sqs:
        intake = SqsIntake(sqs, "http://127.0.0.1:9/123/q", NodeRegistry(), wait_s=0)
        with pytest.raises(AwsError):
            await intake.poll_once()


@pytest.mark.parametrize(
    "body",
    [
        "{}",
        '{"id": "1", "source": "aws.ec2", "detail-type": "EC2 Spot Instance Interruption Warning", "detail": {}}',
        '{"id": "1", "source": "evil", "detail-type": "EC2 Instance Rebalance Recommendation", "detail": {}}',
        '{"id": "1", "source": "aws.ec2", "detail-type": "EC2 Instance State-change Notification", "time": 0,'
        ' "detail": {"instance-id": "i-0123456789abcdef0", "state": "exploded"}}',
        "x" * 300_000,
    ],
)
def test_parse_event_rejects_malformed(body: str) -> None:
    with pytest.raises(ProtocolError):
        parse_event(body, 0.0)


# ---------------------------------------------------------------- several fleets, one account
A1, A2 = "i-0a00000000000000a1", "i-0a00000000000000a2"
B1, B2, B3 = "i-0b00000000000000b1", "i-0b00000000000000b2", "i-0b00000000000000b3"


@pytest.fixture
async def one_rule_two_fleets(aio_session, aws_client_kwargs):
    """One EventBridge rule with one target queue per fleet (what deploy/ sets up)."""
    async with (
        aio_session.create_client("sqs", **aws_client_kwargs) as sqs,
        aio_session.create_client("events", **aws_client_kwargs) as events,
    ):
        urls = {}
        await events.put_rule(Name="fleetd-ec2", EventPattern=json.dumps(EVENT_PATTERN), State="ENABLED")
        for fleet in ("jobA", "jobB"):
            url = (await sqs.create_queue(QueueName=f"fleetd-events-{fleet}"))["QueueUrl"]
            arn = (await sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"]))["Attributes"]["QueueArn"]
            await events.put_targets(Rule="fleetd-ec2", Targets=[{"Id": fleet, "Arn": arn}])
            urls[fleet] = url
        yield sqs, events, urls


async def test_two_fleets_on_one_rule_each_get_every_notice_for_their_own_nodes(one_rule_two_fleets) -> None:
    sqs, events, urls = one_rule_two_fleets
    skew = [0.0]
    clock = lambda: time.time() + skew[0]  # noqa: E731
    fleets = {}
    for name, nodes in (("jobA", (A1, A2)), ("jobB", (B1, B2))):
        registry = NodeRegistry()
        for iid in nodes:
            registry.track(iid)
        fleets[name] = (
            registry,
            SqsIntake(sqs, urls[name], registry, wait_s=0, clock=clock, unknown_grace_s=60.0, unknown_retry_s=0),
        )
    # A correlated wave: every node of both fleets noticed at once, plus B3, which fleet B has just
    # launched and not yet tracked (its first reconcile pass after CreateFleet has not run).
    wave = [
        ec2_event(SPOT_WARNING, {"instance-id": iid, "instance-action": "terminate"}) for iid in (A1, B1, A2, B2, B3)
    ]
    wave.append(ec2_event(REBALANCE, {"instance-id": A2}))
    assert (await events.put_events(Entries=wave))["FailedEntryCount"] == 0

    got: dict[str, list] = {name: [] for name in fleets}
    for name, (_, intake) in fleets.items():
        got[name] += await drain(intake)
    fleets["jobB"][0].track(B3)  # fleet B's next pass sees B3 in DescribeInstances
    for name, (_, intake) in fleets.items():
        got[name] += await drain(intake)

    def notices(name: str) -> set[str]:
        return {e.instance_id for e in got[name] if isinstance(e, InterruptionNotice)}

    assert notices("jobA") == {A1, A2}
    assert notices("jobB") == {B1, B2, B3}
    assert [e.instance_id for e in got["jobA"] if isinstance(e, RebalanceRecommended)] == [A2]
    assert not any(isinstance(e, RebalanceRecommended) for e in got["jobB"])
    # Neither fleet's registry learned of the other's nodes.
    assert {r.instance_id for r in fleets["jobA"][0].records()} == {A1, A2}
    assert {r.instance_id for r in fleets["jobB"][0].records()} == {B1, B2, B3}

    # The other fleet's events wait out the grace on each fleet's own copy, then go for good.
    assert fleets["jobA"][1].deferred > 0 and fleets["jobA"][1].not_ours == 0
    skew[0] = 120.0
    for name, (_, intake) in fleets.items():
        assert await drain(intake) == []
        left = await sqs.receive_message(QueueUrl=urls[name], WaitTimeSeconds=0)
        assert left.get("Messages", []) == [], name
    assert fleets["jobA"][1].not_ours == 3  # B1, B2, B3 on fleet A's queue
    assert fleets["jobB"][1].not_ours == 3  # A1, A2 and A2's rebalance on fleet B's queue


async def test_an_unknown_instances_event_survives_a_controller_restart(eventbridge_queue) -> None:
    """Right after a restart the registry is empty until the first pass: a notice that arrives
    then must not be deleted as "not ours"."""
    sqs, events, queue_url = eventbridge_queue
    registry = NodeRegistry()  # empty: the first reconcile pass has not run yet
    intake = SqsIntake(sqs, queue_url, registry, wait_s=0, unknown_grace_s=60.0, unknown_retry_s=0)
    await events.put_events(Entries=[ec2_event(SPOT_WARNING, {"instance-id": OURS, "instance-action": "terminate"})])
    assert await drain(intake, 1) == []
    assert intake.deferred == 1 and intake.not_ours == 0
    registry.track(OURS)  # the first pass: DescribeInstances finds our node
    (notice,) = await drain(intake)
    assert isinstance(notice, InterruptionNotice) and notice.instance_id == OURS
