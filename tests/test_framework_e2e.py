"""The framework callbacks end to end with real torchrun (CPU, gloo), nodes on 127.0.0.x: a Hugging
Face ``Trainer`` (tiny GPT-2 from a config) and a Lightning ``Trainer``, each with fleetd's callback
and nothing else of fleetd in the script.

Each job trains on 2 nodes; one gets a spot notice (the node's emergency path: agreed step, hold;
the leaver saves nothing and leaves, the survivor saves the step: agent/trainer/hold_plan.py), the
survivor re-forms alone and resumes from exactly the step it last completed; then a replacement node with an empty disk joins, gets the state from its peer and both
resume from the step the survivor last completed. Steps lost = 0 at both changes. Last, the
replacement is lost silently (frozen, as a vanished machine): the survivor's collective hangs until
fleetd's steering drops the silent rank, torchrun's SIGTERM makes the callback save the step it
completed, and it resumes from that step (at most the step in flight is lost).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from agent.supervise.emergency import CheckpointStoreUploader, EmergencyFlow
from agent.trainer import local_ckpt
from agent.trainer.store_link import StoreLink
from fleetd.rendezvous.localcluster import LocalCluster
from tests.harness import cluster_e2e
from tests.harness.cluster_e2e import last_step_before, resumed_after, saves_on_loss

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]
BUCKET = "framework-e2e"


def store_for(aws_client_kwargs: dict, local_dir: Path, job: str):
    return cluster_e2e.store_for(aws_client_kwargs, local_dir, job, bucket=BUCKET)


async def wait_training(
    cluster: LocalCluster, world: int, since: float, nodes: set[str], timeout: float = 180
) -> float:
    return await cluster_e2e.wait_training(cluster, world, since, nodes, timeout)


JOBS = {  # entrypoint, args, what the warm pool imports once
    "hf": ("agent.examples.train_hf", ("--steps", "1000000", "--step-sleep", "0.05"), ("transformers",)),
    # Not "lightning": with it imported in the pool, a torchrun forked from it stopped heartbeating
    # at the first re-rendezvous (a fork-unsafe import); its workers import it cold instead.
    "lightning": ("agent.examples.train_lightning", ("--steps", "1000000", "--step-sleep", "0.05"), ()),
}


@pytest.mark.parametrize("job", sorted(JOBS))
async def test_framework_notice_and_replacement_lose_no_steps(job, tmp_path, aws_client_kwargs):
    entrypoint, args, preload = JOBS[job]
    cluster = LocalCluster(
        tmp_path / "job",
        run_id=f"fw-{job}",
        min_nodes=1,
        max_nodes=3,
        entrypoint=entrypoint,
        train_args=args,
        ckpt_interval=50,
        preload=preload,
        s3_bucket=BUCKET,
        s3_endpoint=aws_client_kwargs["endpoint_url"],
    )
    a, b, c = "127.0.0.2", "127.0.0.3", "127.0.0.4"
    async with store_for(aws_client_kwargs, tmp_path / "agent", cluster.run_id) as store:
        await store.ensure_bucket()
        try:
            await asyncio.to_thread(cluster.start_host)
            cluster.start_steering()
            t0 = time.time()
            cluster.add_node(a)  # one node first: on a busy box a second one may miss its round
            await wait_training(cluster, 1, t0, {a}, timeout=240)
            cluster.add_node(b)
            await wait_training(cluster, 2, t0, {a, b})
            await asyncio.sleep(2.0)

            # -- a spot notice on b: agreed step, b leaves at it, a saves it and goes on alone
            link = await asyncio.to_thread(StoreLink(cluster.host, cluster.port, cluster.run_id).connect)
            flow = EmergencyFlow(
                link, b, cluster.nodes[b], cluster.spec(b).ckpt_dir, uploader=CheckpointStoreUploader(store, writer=b)
            )
            t_notice = time.time()
            outcome = await flow.run(reason="spot notice (test)")
            cluster.nodes.pop(b)
            await wait_training(cluster, 1, t_notice, {a})
            saved = outcome.step
            assert saved is not None and "left at the hold" in outcome.detail, outcome
            last = last_step_before(cluster, 2, time.time())
            assert last == saved, f"ranks ran ahead of the agreed step: saved {saved}, last {last}"
            assert resumed_after(cluster, 1, t_notice) == {saved}
            # The survivor's copy carries the job on (its agent uploads it, as any saved step).
            assert local_ckpt.is_complete(local_ckpt.step_dir(cluster.spec(a).ckpt_dir, saved), "state_dict")
            print(f"{job}: notice at step {saved}: survivor resumed at {saved}, steps lost 0")

            # -- a replacement with an empty disk joins: both resume where the survivor was
            await asyncio.sleep(2.0)
            t_join = time.time()
            cluster.add_node(c)
            await wait_training(cluster, 2, t_join, {a, c})
            first_at_2 = min(cluster.events.training_at(2, t_join, {a, c}).values())
            before = last_step_before(cluster, 1, first_at_2)
            assert resumed_after(cluster, 2, t_join) == {before}, "the join lost steps"
            assert any(e["t"] >= t_join for e in cluster.events.of("state_from_peer", node=c)), (
                "the newcomer's state came from its peer"
            )
            print(f"{job}: replacement joined: resumed at {before} = survivor's last step, steps lost 0")

            # -- the replacement is lost silently: the survivor salvages the step it completed
            await asyncio.sleep(2.0)
            t_freeze = time.time()
            await asyncio.to_thread(cluster.freeze_node, c)
            await wait_training(cluster, 1, t_freeze, {a})
            (resumed_at,) = resumed_after(cluster, 1, t_freeze)
            last = max(e["step"] for e in cluster.events.of("step", world=2, node=a) if e["t"] >= t_join)
            assert last - 1 <= resumed_at <= last + 1, (resumed_at, last)
            # The watcher saves the step completed, or finds it already on disk: the periodic
            # checkpoint (every 50 steps) of the very step the hang followed (a few % of runs).
            salvaged = saves_on_loss(cluster, t_freeze, step=resumed_at, node=a)
            assert salvaged and salvaged[0]["reason"] == "SIGTERM", "saved by the watcher while hung"
            print(f"{job}: silent loss: resumed at {resumed_at}, survivor's last step {last}")
        except BaseException:
            print(cluster.logs())
            raise
        finally:
            await asyncio.to_thread(cluster.close)
