"""A world that forms without the survivor holding the newest salvaged step does not resume from an
older one: the salvage is announced in the rendezvous store, and the new world's rank 0 waits,
bounded, for that node's agent to make it durable in S3 (agent/trainer/resume.py).

The case it covers (bench/chaos.py, CI 2026-11-28): a worker SIGKILLed, its node's torchrun back
in the rendezvous first and a world of one formed from its periodic save while the survivor, which
salvaged 87 steps more, was still restarting. Real parts: a TCPStore as the rendezvous store, moto
server as S3, the checkpointer's own salvage and resume, the agent's uploader's call.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn

from agent.checkpoint_store import CheckpointStore
from agent.trainer import ElasticCheckpointer, TrainerContext, local_ckpt
from agent.trainer.store_link import StoreLink
from fleetd.shared.settings import AwsConfig, CheckpointConfig

BUCKET = "salvage-await"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def store():
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    yield master
    del master


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _ctx(tmp_path: Path, node: str, store, aws_client_kwargs) -> TrainerContext:  # noqa: ANN001
    return TrainerContext(
        store_host="127.0.0.1",
        store_port=store.port,
        run_id="job",
        node_addr=node,
        ckpt_dir=tmp_path / node,
        events_file=tmp_path / f"{node}.events",
        s3_bucket=BUCKET,
        s3_prefix="runs",
        job="await",
        s3_endpoint=aws_client_kwargs["endpoint_url"],
        s3_region=aws_client_kwargs["region_name"],
    )


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def _make_durable(tmp_path: Path, node: str, step: int, aws_client_kwargs) -> None:
    """What the survivor's agent does with a saved step: upload it and move ``latest``."""
    cfg = CheckpointConfig(bucket=BUCKET, prefix="runs", local_dir=tmp_path / node)
    aws = AwsConfig(region=aws_client_kwargs["region_name"], endpoint_url=aws_client_kwargs["endpoint_url"])
    async with CheckpointStore.connect(cfg, aws, job="await", client_config=aws_client_kwargs["config"]) as s3:
        await s3.ensure_bucket()
        d = local_ckpt.step_dir(tmp_path / node, step)
        files, _ = local_ckpt.upload_set(d)
        assert (await s3.upload_step(step, files, writer=node, root=d)).complete


async def _bucket(aws_client_kwargs) -> None:  # noqa: ANN001
    cfg = CheckpointConfig(bucket=BUCKET, prefix="runs", local_dir=Path("/nonexistent"))
    aws = AwsConfig(region=aws_client_kwargs["region_name"], endpoint_url=aws_client_kwargs["endpoint_url"])
    async with CheckpointStore.connect(cfg, aws, job="await", client_config=aws_client_kwargs["config"]) as s3:
        await s3.ensure_bucket()


def _survivor_salvages(tmp_path: Path, store, aws_client_kwargs, step: int) -> nn.Module:  # noqa: ANN001
    """Node b trained to ``step``, its peer was lost, it saved what its parameters hold."""
    model, opt = _model(1)
    ckpt = ElasticCheckpointer(model, opt, ctx=_ctx(tmp_path, "b", store, aws_client_kwargs))
    assert ckpt.update_guard is not None
    ckpt.update_guard.step_done(step)
    saved = ckpt.salvage("peer lost")
    assert saved is not None and saved.step == step
    return model


async def test_a_world_without_the_survivor_resumes_from_its_salvage_once_durable(
    tmp_path: Path, store, aws_client_kwargs, monkeypatch
) -> None:
    monkeypatch.setenv("FLEETD_SALVAGE_AWAIT_S", "60")
    # Node a: the killed worker's node, holding only its periodic save at 800.
    model_a, opt_a = _model(0)
    ElasticCheckpointer(model_a, opt_a, ctx=_ctx(tmp_path, "a", store, aws_client_kwargs)).save(800)
    salvaged = _survivor_salvages(tmp_path, store, aws_client_kwargs, 887)
    assert StoreLink("127.0.0.1", store.port, "job").connect().salvaged().step == 887  # type: ignore[union-attr]

    # b's agent uploads the salvage 3 s later, while a's new world is already resuming.
    loop = asyncio.get_running_loop()
    upload = threading.Timer(
        3.0,
        lambda: asyncio.run_coroutine_threadsafe(_make_durable(tmp_path, "b", 887, aws_client_kwargs), loop).result(),
    )
    model, opt = _model(2)
    alone = ElasticCheckpointer(model, opt, ctx=_ctx(tmp_path, "a", store, aws_client_kwargs))
    started = time.monotonic()
    upload.start()
    try:
        step = await asyncio.to_thread(alone.resume)
    finally:
        upload.join()
    assert step == 887
    assert time.monotonic() - started >= 3.0
    assert all(
        torch.equal(x, y) for x, y in zip(model.state_dict().values(), salvaged.state_dict().values(), strict=True)
    )
    evs = [e["ev"] for e in _events(tmp_path / "a.events")]
    assert "awaiting_salvage" in evs and "salvage_durable" in evs and "salvage_unreachable" not in evs


async def test_a_salvage_that_never_lands_is_given_up_once(
    tmp_path: Path, store, aws_client_kwargs, monkeypatch
) -> None:
    monkeypatch.setenv("FLEETD_SALVAGE_AWAIT_S", "2")
    await _bucket(aws_client_kwargs)
    model_a, opt_a = _model(0)
    ElasticCheckpointer(model_a, opt_a, ctx=_ctx(tmp_path, "a", store, aws_client_kwargs)).save(800)
    _survivor_salvages(tmp_path, store, aws_client_kwargs, 887)  # and its node is gone before uploading

    model, opt = _model(2)
    first = ElasticCheckpointer(model, opt, ctx=_ctx(tmp_path, "a", store, aws_client_kwargs))
    assert await asyncio.to_thread(first.resume) == 800
    evs = [e["ev"] for e in _events(tmp_path / "a.events")]
    assert "awaiting_salvage" in evs and "salvage_unreachable" in evs
    assert StoreLink("127.0.0.1", store.port, "job").connect().salvaged().step == 800  # type: ignore[union-attr]

    # The next world (a re-form) does not wait for it again: with a 30 s wait now, a wait would
    # show plainly, while a loaded box's slow resume (2.2 s seen under test-fast) does not.
    monkeypatch.setenv("FLEETD_SALVAGE_AWAIT_S", "30")
    (tmp_path / "a.events").unlink()
    again = ElasticCheckpointer(*_model(3), ctx=_ctx(tmp_path, "a", store, aws_client_kwargs))
    started = time.monotonic()
    assert await asyncio.to_thread(again.resume) == 800
    assert time.monotonic() - started < 20.0
    assert "awaiting_salvage" not in [e["ev"] for e in _events(tmp_path / "a.events")]


async def test_a_world_holding_the_salvaged_step_does_not_wait(tmp_path: Path, store, aws_client_kwargs) -> None:
    _survivor_salvages(tmp_path, store, aws_client_kwargs, 887)
    model, opt = _model(2)
    survivor = ElasticCheckpointer(model, opt, ctx=_ctx(tmp_path, "b", store, aws_client_kwargs))
    assert await asyncio.to_thread(survivor.resume) == 887
    assert "awaiting_salvage" not in [e["ev"] for e in _events(tmp_path / "b.events")]
