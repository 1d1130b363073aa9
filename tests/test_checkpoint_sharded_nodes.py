"""Sharded (torch DCP) checkpoints written by two nodes become one durable step in S3.

Two real gloo ranks, each with a checkpoint directory of its own (two nodes), save the same step
with torch.distributed.checkpoint: each node ends up with only part of the files, and only the
node of rank 0 holds ``.metadata``. Each node uploads its part as the agent does
(local_ckpt.upload_set). The step must become complete in S3 only once both parts are there,
whichever node finishes first, and a restore must give a directory DCP can load.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from agent.checkpoint_store import CheckpointStore
from agent.trainer import ElasticCheckpointer, TrainerContext, local_ckpt
from fleetd.shared.settings import AwsConfig, CheckpointConfig
from tests.harness.ports import free_port

BUCKET = "sharded-nodes"
STEP = 4
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _two_nodes_save_dcp(tmp_path: Path) -> tuple[Path, Path]:
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
            "FLEETD_CKPT_DIR": str(tmp_path / f"node{rank}"),
            "FLEETD_CKPT_INTERVAL": str(STEP),
        }
        cmd = [
            sys.executable,
            "-m",
            "agent.examples.toy_job.train_toy",
            "--mode",
            "dcp",
            "--steps",
            str(STEP),
            "--step-sleep",
            "0",
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
    return tmp_path / "node0", tmp_path / "node1"


def _store(aws_client_kwargs: dict, local: Path, node: str):
    cfg = CheckpointConfig(bucket=BUCKET, prefix="runs", local_dir=local)
    aws = AwsConfig(region=aws_client_kwargs["region_name"], endpoint_url=aws_client_kwargs["endpoint_url"])
    return CheckpointStore.connect(cfg, aws, job=f"dcp-{node}", client_config=aws_client_kwargs["config"])


@pytest.mark.parametrize("metadata_node_first", [False, True])
async def test_two_nodes_parts_of_a_dcp_step_publish_once_both_are_in(tmp_path, aws_client_kwargs, metadata_node_first):
    node0, node1 = _two_nodes_save_dcp(tmp_path)
    dir0, dir1 = local_ckpt.step_dir(node0, STEP), local_ckpt.step_dir(node1, STEP)
    names0 = {p.name for p in dir0.iterdir()}
    names1 = {p.name for p in dir1.iterdir()}
    # Each node holds a part: neither directory is a whole checkpoint on its own.
    assert ".metadata" in names0 and ".metadata" not in names1
    assert any(n.endswith(".distcp") for n in names1)
    assert not local_ckpt.is_complete(dir0, "dcp") and not local_ckpt.is_complete(dir1, "dcp")

    files0, step_files0 = local_ckpt.upload_set(dir0)
    files1, step_files1 = local_ckpt.upload_set(dir1)
    assert step_files1 is None and set(step_files0) == {".metadata"} | {
        n for n in names0 | names1 if n.endswith(".distcp")
    }
    assert local_ckpt.MARKER not in {p.name for p in files0 + files1}  # each node's own, stays local

    job = "first-meta" if metadata_node_first else "first-part"
    order = [("n0", dir0, files0, step_files0), ("n1", dir1, files1, step_files1)]
    if not metadata_node_first:
        order.reverse()
    async with _store(aws_client_kwargs, tmp_path / "agent", job) as store:
        await store.ensure_bucket()
        writer, root, files, step_files = order[0]
        first = await store.upload_step(STEP, files, writer=writer, root=root, step_files=step_files)
        assert not first.complete and await store.complete_steps() == []  # half a step is not durable
        writer, root, files, step_files = order[1]
        second = await store.upload_step(STEP, files, writer=writer, root=root, step_files=step_files)
        assert second.complete and await store.complete_steps() == [STEP]
        manifest = await store.publisher.read_manifest(STEP)
        assert set(manifest.writers) == {"n0", "n1"}
        assert {f.name for f in manifest.files} == set(step_files0)

        restored = await store.restore_latest(tmp_path / "fresh")
    assert restored is not None and restored.step == STEP
    fresh = local_ckpt.step_dir(tmp_path / "fresh", STEP)
    assert local_ckpt.is_complete(fresh, "dcp")

    # A single process loads the two nodes' step (DCP reshards on load).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = ElasticCheckpointer(model, opt, mode="dcp", ctx=TrainerContext(ckpt_dir=tmp_path / "fresh"))
    assert ckpt.resume() == STEP
    assert opt.state_dict()["state"], "optimizer state (momentum) restored too"
