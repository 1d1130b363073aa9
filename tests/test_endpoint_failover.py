"""A leader-host loss, as the agent sees it: the rendezvous store is SIGKILLed, the new leader's
store starts on another host:port and its endpoint is published, retained, on the real broker.
The node's torchrun supervisor (``ElasticHooks``, fed by the agent's real MQTT session) restarts
torchrun against the new store once, and training resumes from the step it saved (issue 19).

Real components: mosquitto, the ``fleetd rendezvous`` host processes, fleetd's steering, the
agent's MqttSession and torchrun on CPU/gloo. No timed asserts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiomqtt
import pytest

from agent.node.mqtt_session import MqttSession
from agent.node.outbox import Outbox
from fleetd.protocol.messages import RendezvousEndpoint
from fleetd.protocol.topics import rendezvous_topic
from fleetd.rendezvous.localcluster import LocalCluster, free_port
from fleetd.shared.settings import MqttConfig
from tests.test_store_restart import Recorder, hooks_for, kill_host, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

FLEET = "hafailover"


async def test_store_moves_to_a_new_host_and_training_resumes_there(tmp_path, mosquitto):
    cluster = LocalCluster(
        tmp_path / "job",
        run_id="mv",
        min_nodes=1,
        max_nodes=2,
        train_args=("--steps", "1000000", "--step-sleep", "0.05"),
    )
    a = "127.0.0.2"
    rec = Recorder()
    topic = rendezvous_topic(FLEET)
    with cluster:
        await asyncio.to_thread(cluster.start_host)
        cluster.start_steering()
        old_port = cluster.port
        hooks = hooks_for(cluster, a, rec)
        session = MqttSession(
            MqttConfig(url=mosquitto.url, keepalive_s=5),
            fleet=FLEET,
            instance_id="i-0000000000000f001",
            outbox=Outbox(None),
            on_command=rec.publish,
            on_endpoint=hooks.on_endpoint,
        )
        tasks = [asyncio.create_task(hooks.run()), asyncio.create_task(session.run())]
        try:
            async with aiomqtt.Client(mosquitto.host, mosquitto.port) as ctl:
                # The first leader's word: the store torchrun already uses (adopted, no restart).
                first = RendezvousEndpoint(
                    host=cluster.host, port=old_port, run_id=cluster.run_id, leader="ctl-a", generation=1
                )
                await ctl.publish(topic, first.to_json(), qos=1, retain=True)
                t0 = time.time()
                await asyncio.to_thread(cluster.events.wait_training, 1, t0, 180, {a})
                await wait_until(lambda: hooks.endpoint is not None, 30, "first endpoint adopted", cluster)
                assert hooks.starts == 1 and hooks.endpoint_restarts == 0
                await asyncio.sleep(2.0)

                # -- the leader's host is lost: its store and its steering die with it
                kill_host(cluster)
                cluster.kill_steering()
                t_kill = time.time()
                step_at_kill = cluster.events.last_step()
                # -- the new leader starts its store on another port and publishes it
                cluster.port = free_port(cluster.host)
                await asyncio.to_thread(cluster.start_host)
                cluster.start_steering()
                moved = RendezvousEndpoint(
                    host=cluster.host, port=cluster.port, run_id=cluster.run_id, leader="ctl-b", generation=2
                )
                await ctl.publish(topic, moved.to_json(), qos=1, retain=True)
                t_pub = time.time()
                step_at_publish = cluster.events.last_step()
                await wait_until(lambda: hooks.starts == 2, 90, "torchrun restarted against the new store", cluster)
                assert hooks.spec.rdzv_port == cluster.port != old_port
                await asyncio.to_thread(cluster.events.wait_training, 1, time.time(), 180, {a})
                t_trained = time.time()

                # the same message again (as every reconnect delivers it) and a deposed leader's late
                # word: neither restarts anything
                await ctl.publish(topic, moved.to_json(), qos=1, retain=True)
                await ctl.publish(topic, first.to_json(), qos=1)
                await asyncio.sleep(3.0)
                assert hooks.starts == 2 and hooks.endpoint_restarts == 1
                assert hooks.spec.rdzv_port == cluster.port

                resumed = [e["from_step"] for e in cluster.events.of("resumed") if e["t"] >= t_kill]
                assert resumed, cluster.logs()
                assert min(resumed) >= step_at_kill, (resumed, step_at_kill)
                before = cluster.events.last_step()
                await asyncio.sleep(3.0)
                assert cluster.events.last_step() > before, "training stopped on the new store"
                print(
                    f"HA_FOLLOW step_at_kill={step_at_kill} step_at_publish={step_at_publish} resumed_from={min(resumed)} "
                    f"published_to_training_s={t_trained - t_pub:.1f} kill_to_training_s={t_trained - t_kill:.1f}"
                )
                await ctl.publish(topic, b"", qos=1, retain=True)
        finally:
            await hooks.stop()
            for t in tasks:
                t.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)


async def test_folder_mode_follows_the_new_store_and_resumes_from_the_scripts_save(
    tmp_path, mosquitto, aws_client_kwargs
):
    """Folder mode (a script that only saves to a folder when told, SIGUSR1) follows the leader's
    new store too: asked to save first, then torchrun restarted once against the new store, and
    the script resumes from that save in its own folder."""
    import re
    from dataclasses import replace

    from agent.checkpoint_store import CheckpointStore
    from agent.supervise.folder_hooks import FolderSettings
    from fleetd.shared.settings import AwsConfig, CheckpointConfig
    from tests.test_folder_mode_e2e import BUCKET, SAVE_ON_SIGNAL, Node

    script = tmp_path / "save_on_signal.py"
    script.write_text(SAVE_ON_SIGNAL)
    cluster = LocalCluster(
        tmp_path / "job",
        run_id="fmove",
        min_nodes=1,
        max_nodes=2,
        s3_bucket=BUCKET,
        s3_endpoint=aws_client_kwargs["endpoint_url"],
    )
    node = Node(cluster, "127.0.0.2", aws_client_kwargs)
    node.hooks.spec = replace(
        node.hooks.spec, entrypoint=str(script), args=(str(node.folder / "state.pt"),), job="fmove"
    )
    node.hooks.folder = FolderSettings(node.folder, "SIGUSR1", 0.5)
    hooks = node.hooks
    topic = rendezvous_topic(FLEET)
    cfg = CheckpointConfig(bucket=BUCKET, prefix="checkpoints", local_dir=tmp_path / "check")
    aws = AwsConfig(region=aws_client_kwargs["region_name"], endpoint_url=aws_client_kwargs["endpoint_url"])
    session = MqttSession(
        MqttConfig(url=mosquitto.url, keepalive_s=5),
        fleet=FLEET,
        instance_id="i-0000000000000f002",
        outbox=Outbox(None),
        on_command=Recorder().publish,
        on_endpoint=hooks.on_endpoint,
    )
    tasks: list[asyncio.Task] = []

    def starts_at() -> list[int]:
        return [int(s) for s in re.findall(r"^start (\d+)$", node.text(), re.M)]

    try:
        async with CheckpointStore.connect(cfg, aws, job="fmove", client_config=aws_client_kwargs["config"]) as store:
            await store.ensure_bucket()
            await asyncio.to_thread(cluster.start_host)
            cluster.start_steering()
            old_port = cluster.port
            await node.start(cluster)
            tasks.append(asyncio.create_task(session.run()))
            async with aiomqtt.Client(mosquitto.host, mosquitto.port) as ctl:
                first = RendezvousEndpoint(
                    host=cluster.host, port=old_port, run_id=cluster.run_id, leader="ctl-a", generation=1
                )
                await ctl.publish(topic, first.to_json(), qos=1, retain=True)
                await wait_until(lambda: "step 20" in node.text(), 180, "training", cluster)
                await wait_until(lambda: hooks.endpoint is not None, 30, "first endpoint adopted", cluster)
                assert hooks.starts == 1 and hooks.endpoint_restarts == 0 and starts_at() == [0]

                # -- the leader's host is lost; the new leader's store is on another port
                kill_host(cluster)
                cluster.kill_steering()
                step_at_kill = max(int(s) for s in re.findall(r"^step (\d+)$", node.text(), re.M))
                cluster.port = free_port(cluster.host)
                await asyncio.to_thread(cluster.start_host)
                cluster.start_steering()
                moved = RendezvousEndpoint(
                    host=cluster.host, port=cluster.port, run_id=cluster.run_id, leader="ctl-b", generation=2
                )
                await ctl.publish(topic, moved.to_json(), qos=1, retain=True)
                await wait_until(lambda: hooks.starts == 2, 120, "torchrun restarted against the new store", cluster)
                cluster.nodes[node.addr] = hooks.torchrun  # close() ends it whatever happens
                assert hooks.spec.rdzv_port == cluster.port != old_port
                await wait_until(lambda: len(starts_at()) == 2, 180, "the script started again", cluster)
                saved = [int(s) for s in re.findall(r"^saved (\d+)$", node.text(), re.M)]
                assert len(saved) == 1, node.text()[-800:]
                # The save asked for before the move is what the script resumes from.
                assert starts_at()[1] == saved[0] >= step_at_kill, (starts_at(), saved, step_at_kill)
                offset = len(node.text().encode())
                await wait_until(
                    lambda: re.search(r"^step \d+$", node.text(offset), re.M), 60, "steps on the new store", cluster
                )

                # Redelivered and stale messages restart nothing; the job is still running.
                await ctl.publish(topic, moved.to_json(), qos=1, retain=True)
                await ctl.publish(topic, first.to_json(), qos=1)
                await asyncio.sleep(3.0)
                assert hooks.starts == 2 and hooks.endpoint_restarts == 1
                assert node.task is not None and not node.task.done()
                assert hooks.torchrun is not None and hooks.torchrun.running
                print(f"FOLDER_FOLLOW step_at_kill={step_at_kill} saved={saved[0]} resumed_at={starts_at()[1]}")
                await ctl.publish(topic, b"", qos=1, retain=True)
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        await hooks.stop()
        for t in [*tasks, *([node.task] if node.task is not None else [])]:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(cluster.close)
