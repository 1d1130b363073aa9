"""Replicated (DDP) checkpoints written by several nodes restore from S3 (the whole-fleet case).

With replicated state every node uploads the same step under the same keys. Each node's copy had
its own completion marker (its own ``saved_at``); when the markers were uploaded too, a later
node's marker overwrote the one the manifest hashed, and every restore failed with a sha256
mismatch: after a notice that took the whole fleet, the replacements started from step 0. Now the
marker has the same bytes on every node and stays local: every uploaded key is the same on every
node.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch
from torch import nn

from agent.checkpoint_store import CheckpointStore
from agent.trainer import ElasticCheckpointer, TrainerContext, local_ckpt
from fleetd.shared.settings import AwsConfig, CheckpointConfig

BUCKET = "replicated-nodes"
STEP = 7


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


async def test_every_nodes_copy_uploaded_and_a_fresh_node_resumes_from_s3(tmp_path: Path, aws_client_kwargs) -> None:
    dirs = []
    for node in ("n0", "n1", "n2"):
        model, opt = _model()
        ckpt = ElasticCheckpointer(model, opt, ctx=TrainerContext(ckpt_dir=tmp_path / node))
        ckpt.save(STEP)
        dirs.append(local_ckpt.step_dir(tmp_path / node, STEP))
        time.sleep(0.01)  # a marker that recorded when it was saved would now differ
    assert len({(d / local_ckpt.MARKER).read_text() for d in dirs}) == 1

    cfg = CheckpointConfig(bucket=BUCKET, prefix="runs", local_dir=tmp_path / "agent")
    aws = AwsConfig(region=aws_client_kwargs["region_name"], endpoint_url=aws_client_kwargs["endpoint_url"])
    async with CheckpointStore.connect(cfg, aws, job="toy", client_config=aws_client_kwargs["config"]) as store:
        await store.ensure_bucket()
        for node, d in zip(("n0", "n1", "n2"), dirs, strict=True):  # as the agents do, one after the other
            files, step_files = local_ckpt.upload_set(d)
            assert step_files is None and local_ckpt.MARKER not in {p.name for p in files}
            result = await store.upload_step(STEP, files, writer=node, root=d, step_files=step_files)
            assert result.complete
        assert await store.complete_steps() == [STEP]

    # A replacement with no local copy: resume() restores from S3 (the real path) and loads it.
    model, opt = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # differs from the saved state until it is loaded
    fresh = ElasticCheckpointer(
        model,
        opt,
        ctx=TrainerContext(
            ckpt_dir=tmp_path / "fresh",
            s3_bucket=BUCKET,
            s3_prefix="runs",
            job="toy",
            s3_endpoint=aws_client_kwargs["endpoint_url"],
            s3_region=aws_client_kwargs["region_name"],
        ),
    )
    assert await asyncio.to_thread(fresh.resume) == STEP  # resume() runs its own event loop
    assert local_ckpt.is_complete(local_ckpt.step_dir(tmp_path / "fresh", STEP), "state_dict")
    saved, _ = _model()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values(), strict=True))


async def test_a_newer_durable_step_in_s3_beats_a_stale_local_copy(tmp_path: Path, aws_client_kwargs) -> None:
    """A node that dropped out of the world holds step 3 locally while the others trained to 7,
    made it durable and left: it must resume from 7, not 3."""
    model, opt = _model()
    trained = ElasticCheckpointer(model, opt, ctx=TrainerContext(ckpt_dir=tmp_path / "others"))
    trained.save(STEP)
    cfg = CheckpointConfig(bucket=BUCKET, prefix="runs", local_dir=tmp_path / "agent")
    aws = AwsConfig(region=aws_client_kwargs["region_name"], endpoint_url=aws_client_kwargs["endpoint_url"])
    async with CheckpointStore.connect(cfg, aws, job="stale", client_config=aws_client_kwargs["config"]) as store:
        await store.ensure_bucket()
        d = local_ckpt.step_dir(tmp_path / "others", STEP)
        files, _ = local_ckpt.upload_set(d)
        assert (await store.upload_step(STEP, files, writer="n0", root=d)).complete

    stale_model, stale_opt = _model()
    with torch.no_grad():
        for p in stale_model.parameters():
            p.mul_(-1.0)  # what it held at step 3
    ctx = dict(
        s3_bucket=BUCKET,
        s3_prefix="runs",
        job="stale",
        s3_endpoint=aws_client_kwargs["endpoint_url"],
        s3_region=aws_client_kwargs["region_name"],
    )
    ElasticCheckpointer(stale_model, stale_opt, ctx=TrainerContext(ckpt_dir=tmp_path / "dropped", **ctx)).save(3)
    model2, opt2 = _model()
    behind = ElasticCheckpointer(model2, opt2, ctx=TrainerContext(ckpt_dir=tmp_path / "dropped", **ctx))
    assert await asyncio.to_thread(behind.resume) == STEP
    saved, _ = _model()
    assert all(
        torch.equal(a, b) for a, b in zip(model2.state_dict().values(), saved.state_dict().values(), strict=True)
    )
