"""Helpers shared by the end-to-end tests that run a LocalCluster of real torchruns (plain loop,
Hugging Face and Lightning jobs): the S3 checkpoint store they ship to, and reading the trainers'
events file."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agent.checkpoint_store import CheckpointStore
from fleetd.rendezvous.localcluster import LocalCluster
from fleetd.shared.settings import AwsConfig, CheckpointConfig


def store_for(aws_client_kwargs: dict, local_dir: Path, job: str, *, bucket: str):
    cfg = CheckpointConfig(bucket=bucket, prefix="checkpoints", local_dir=local_dir)
    aws = AwsConfig(region=aws_client_kwargs["region_name"], endpoint_url=aws_client_kwargs["endpoint_url"])
    return CheckpointStore.connect(cfg, aws, job=job, client_config=aws_client_kwargs["config"])


async def wait_training(
    cluster: LocalCluster, world: int, since: float, nodes: set[str], timeout: float = 120
) -> float:
    try:
        return await asyncio.to_thread(cluster.events.wait_training, world, since, timeout, nodes)
    except TimeoutError:
        print(cluster.logs())
        raise


def resumed_after(cluster: LocalCluster, world: int, since: float) -> set[int]:
    return {e["from_step"] for e in cluster.events.of("resumed", world=world) if e["t"] >= since}


def last_step_before(cluster: LocalCluster, world: int, until: float) -> int:
    return max(e["step"] for e in cluster.events.of("step", world=world) if e["t"] < until)


def saves_on_loss(cluster: LocalCluster, since: float, *, step: int, node: str | None = None) -> list[dict]:
    """The salvages since ``since`` (on ``node``, if given): a step saved when a peer was lost, or
    ``step`` found already on disk (a periodic checkpoint of that very step landed just before the
    loss; the salvage then says so and skips: a few % of runs)."""
    match = {} if node is None else {"node": node}
    saved = [e for e in cluster.events.of("salvaged", **match) if e["t"] >= since]
    skipped = [
        e
        for e in cluster.events.of("salvage_skipped", **match)
        if e["t"] >= since and e.get("step") == step and "already saved" in e.get("why", "")
    ]
    return sorted(saved + skipped, key=lambda e: e["t"])
