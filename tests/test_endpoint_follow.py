"""The agent follows the leading controller's advertised rendezvous store (issue 19, item 3).

Pure rules (agent.supervise.endpoint_follow.follow), then the agent's real MQTT session against a
real mosquitto: the retained endpoint reaches the hooks, bad or foreign messages do not.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import aiomqtt
from hypothesis import given
from hypothesis import strategies as st

from agent.hooks import AgentContext, LoggingHooks
from agent.main import Agent
from agent.supervise.endpoint_follow import FollowAction, StoreEndpoint, follow
from fleetd.demo.configs import trainer_socket_for
from fleetd.protocol.messages import RendezvousEndpoint
from fleetd.protocol.topics import rendezvous_topic

RUN = "job-1"


def adv(host: str = "10.0.0.2", port: int = 29400, generation: int = 2, run_id: str = RUN) -> RendezvousEndpoint:
    return RendezvousEndpoint(host=host, port=port, run_id=run_id, leader="ctl-b", generation=generation)


def test_a_new_host_restarts_torchrun_against_it():
    d = follow(StoreEndpoint("10.0.0.1", 29400), adv(), RUN)
    assert d.action is FollowAction.RESTART and d.endpoint == StoreEndpoint("10.0.0.2", 29400, 2)


def test_a_new_port_on_the_same_host_restarts_too():
    d = follow(StoreEndpoint("10.0.0.2", 29400, 1), adv(port=29401), RUN)
    assert d.action is FollowAction.RESTART and d.endpoint.port == 29401


def test_the_store_torchrun_already_uses_is_adopted_without_a_restart():
    d = follow(StoreEndpoint("10.0.0.2", 29400), adv(generation=5), RUN)
    assert d.action is FollowAction.ADOPT and d.endpoint == StoreEndpoint("10.0.0.2", 29400, 5)


def test_a_redelivered_or_older_endpoint_is_stale():
    current = StoreEndpoint("10.0.0.2", 29400, 3)
    assert follow(current, adv(generation=3), RUN).action is FollowAction.STALE
    old = follow(current, adv(host="10.0.0.1", generation=2), RUN)  # a deposed leader's late word
    assert old.action is FollowAction.STALE and old.endpoint == current


def test_another_runs_store_is_never_followed():
    current = StoreEndpoint("10.0.0.1", 29400)
    d = follow(current, adv(run_id="other"), RUN)
    assert d.action is FollowAction.OTHER_RUN and d.endpoint == current


endpoints = st.builds(
    adv,
    host=st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.3"]),
    port=st.sampled_from([29400, 29401]),
    generation=st.integers(0, 6),
    run_id=st.sampled_from([RUN, RUN, "other"]),
)


@given(st.lists(endpoints, max_size=30))
def test_once_per_change_and_generations_never_go_back(messages):
    """Any delivery order, repeats included: one restart per accepted change of host:port, the
    followed generation never decreases, and every message delivered twice in a row is a no-op."""
    cur = StoreEndpoint("10.0.0.1", 29400)
    for m in messages:
        d = follow(cur, m, RUN)
        if cur.generation is not None and d.endpoint.generation is not None:
            assert d.endpoint.generation >= cur.generation
        assert (d.action is FollowAction.RESTART) == ((d.endpoint.host, d.endpoint.port) != (cur.host, cur.port))
        cur = d.endpoint
        assert follow(cur, m, RUN).action in (FollowAction.STALE, FollowAction.OTHER_RUN)


# ------------------------------------------------------------------ the agent, real broker
FLEET = "hafollow"


class EndpointHooks(LoggingHooks):
    instances: list[EndpointHooks] = []

    def __init__(self, ctx: AgentContext) -> None:
        super().__init__(ctx)
        self.endpoints: list[RendezvousEndpoint] = []
        EndpointHooks.instances.append(self)

    async def on_endpoint(self, endpoint: RendezvousEndpoint) -> None:
        self.endpoints.append(endpoint)


async def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def test_agent_receives_the_retained_endpoint_and_rejects_bad_ones(mosquitto):
    from agent.config import AgentConfig, NodeConfig
    from agent.doubles.fake_imds import FakeImds
    from fleetd.shared.settings import MqttConfig

    topic = rendezvous_topic(FLEET)
    first = adv(generation=1)
    EndpointHooks.instances.clear()
    with tempfile.TemporaryDirectory(prefix="fe-", dir="/tmp") as d:
        state = Path(d)
        async with (
            FakeImds(instance_id="i-00000000000000e01") as fake,
            aiomqtt.Client(mosquitto.host, mosquitto.port) as ctl,
        ):
            # Published before the agent exists: retained, so the agent gets it on connect.
            await ctl.publish(topic, first.to_json(), qos=1, retain=True)
            cfg = AgentConfig(
                node=NodeConfig(
                    fleet=FLEET,
                    imds_url=fake.url,
                    state_dir=state,
                    trainer_socket=trainer_socket_for(state),
                    shutdown_timeout_s=5,
                ),
                mqtt=MqttConfig(url=mosquitto.url, keepalive_s=5),
            )
            agent = Agent(cfg, EndpointHooks)
            task = asyncio.create_task(agent.run())
            try:
                await wait_until(lambda: bool(EndpointHooks.instances) and EndpointHooks.instances[-1].endpoints)
                hooks = EndpointHooks.instances[-1]
                bad_version = json.loads(first.to_json())
                bad_version["schema_version"] = 99
                for payload in (
                    b"{garbage",
                    json.dumps(bad_version).encode(),
                    b'{"kind": "rendezvous-endpoint"}',
                    b"x" * 70_000,
                ):
                    await ctl.publish(topic, payload, qos=1)
                second = adv(host="10.0.0.3", generation=2)
                await ctl.publish(topic, second.to_json(), qos=1, retain=True)
                await wait_until(lambda: len(hooks.endpoints) >= 2)
                assert not task.done(), "bad endpoint messages stopped the agent"
                assert hooks.endpoints == [first, second]
            finally:
                agent.request_stop()
                await asyncio.wait_for(task, 15)
                await ctl.publish(topic, b"", qos=1, retain=True)  # clear the retained message
