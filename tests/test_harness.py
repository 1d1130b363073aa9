"""The harness itself: aiomqtt talks to the real mosquitto; aiobotocore talks to moto server."""

from __future__ import annotations

import asyncio

import aiomqtt

from fleetd.protocol import Status, node_topic, parse_message


async def test_aiomqtt_round_trip_through_mosquitto(mosquitto) -> None:
    topic = node_topic("harness", "i-0abc", "status")
    msg = Status(instance_id="i-0abc", state="ready")
    async with aiomqtt.Client(mosquitto.host, mosquitto.port, identifier="sub") as sub:
        await sub.subscribe(topic, qos=1)
        async with aiomqtt.Client(mosquitto.host, mosquitto.port, identifier="pub") as pub:
            await pub.publish(topic, msg.to_json(), qos=1)
        async with asyncio.timeout(5):
            async for received in sub.messages:
                assert str(received.topic) == topic
                assert parse_message(received.payload) == msg
                break


async def test_ec2_and_s3_on_moto_through_aiobotocore(aio_session, aws_client_kwargs) -> None:
    async with aio_session.create_client("ec2", **aws_client_kwargs) as ec2:
        images = await ec2.describe_images(Owners=["amazon"])
        ami = images["Images"][0]["ImageId"]
        run = await ec2.run_instances(
            ImageId=ami,
            InstanceType="g5.xlarge",
            MinCount=2,
            MaxCount=2,
            TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": "fleetd:fleet", "Value": "h"}]}],
        )
        assert len(run["Instances"]) == 2
        desc = await ec2.describe_instances(Filters=[{"Name": "tag:fleetd:fleet", "Values": ["h"]}])
        assert sum(len(r["Instances"]) for r in desc["Reservations"]) == 2
    async with aio_session.create_client("s3", **aws_client_kwargs) as s3:
        await s3.create_bucket(Bucket="harness")
        await s3.put_object(Bucket="harness", Key="a/b", Body=b"hello")
        obj = await s3.get_object(Bucket="harness", Key="a/b")
        async with obj["Body"] as body:
            assert await body.read() == b"hello"


async def test_moto_state_is_reset_between_tests(aio_session, aws_client_kwargs) -> None:
    async with aio_session.create_client("s3", **aws_client_kwargs) as s3:
        buckets = await s3.list_buckets()
        assert buckets["Buckets"] == []
