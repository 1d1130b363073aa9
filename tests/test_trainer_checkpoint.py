"""The training-side helper in one process: data sharding, local checkpoints (state_dict and
DCP), and the checkpoint-request handshake against a real c10d store."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed import TCPStore

from agent.trainer import ElasticCheckpointer, TrainerContext, local_ckpt
from agent.trainer.data import loss_weight, rank_indices, rank_slice, step_indices
from agent.trainer.store_link import StoreLink
from fleetd.protocol import rendezvous_keys as keys


# ---------------------------------------------------------------------- data sharding
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7])
def test_rank_slices_cover_the_global_batch_exactly_once(world):
    covered = [i for r in range(world) for i in range(64)[rank_slice(64, r, world)]]
    assert covered == list(range(64))
    sizes = [rank_slice(64, r, world).stop - rank_slice(64, r, world).start for r in range(world)]
    assert max(sizes) - min(sizes) <= 1


def test_a_steps_samples_do_not_depend_on_the_world_size():
    for step in (1, 7, 64, 65):
        expected = step_indices(step, 64, 4096)
        for world in (1, 2, 3):
            got = [i for r in range(world) for i in rank_indices(step, 64, 4096, r, world)]
            assert got == expected
    assert step_indices(1, 64, 4096) != step_indices(2, 64, 4096)


def test_loss_weights_make_the_gradient_the_global_mean():
    # DDP averages over ranks; weighted local means must equal the global-batch mean.
    values = torch.arange(10, dtype=torch.float64)
    world = 3
    per_rank = [values[rank_slice(10, r, world)].mean() * loss_weight(10, r, world) for r in range(world)]
    assert torch.stack(per_rank).mean().item() == pytest.approx(values.mean().item())


# ---------------------------------------------------------------------- local checkpoints
def test_plain_checkpoints_are_atomic_newest_first_and_pruned(tmp_path):
    for step in (5, 10, 15, 20):
        local_ckpt.save_plain(tmp_path, step, {"w": torch.tensor([step])})
    (tmp_path / "step-25").mkdir()  # an interrupted save: no marker
    assert local_ckpt.newest_complete(tmp_path, "state_dict") == 20
    assert local_ckpt.load_plain(tmp_path, 20)["w"].item() == 20
    local_ckpt.prune(tmp_path, keep=2)
    assert local_ckpt.local_steps(tmp_path) == [25, 20]


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return m, opt


@pytest.mark.parametrize("mode", ["state_dict", "dcp"])
def test_save_then_resume_restores_model_and_optimizer(tmp_path, mode):
    ctx = TrainerContext(ckpt_dir=tmp_path)
    model, opt = _model()
    saver = ElasticCheckpointer(model, opt, mode=mode, ctx=ctx)
    saver.save(7)
    assert local_ckpt.is_complete(local_ckpt.step_dir(tmp_path, 7), mode)

    fresh = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    loader = ElasticCheckpointer(fresh, fresh_opt, mode=mode, ctx=ctx)
    assert loader.resume() == 7
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    momentum = [s["momentum_buffer"] for s in fresh_opt.state_dict()["state"].values()]
    assert momentum and all(m is not None for m in momentum)


def test_fresh_start_without_any_checkpoint(tmp_path):
    model, opt = _model()
    assert ElasticCheckpointer(model, opt, ctx=TrainerContext(ckpt_dir=tmp_path)).resume() == 0


# ---------------------------------------------------------------------- the request handshake
@pytest.fixture
def store():
    server = TCPStore(
        "127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    yield server
    del server


def _ctx(store, tmp_path: Path, **kw) -> TrainerContext:
    return TrainerContext(
        store_host="127.0.0.1",
        store_port=store.port,
        run_id="t",
        node_addr="127.0.0.2",
        ckpt_dir=tmp_path,
        events_file=tmp_path / "events.jsonl",
        **kw,
    )


def test_request_is_saved_at_the_current_step_and_acknowledged(store, tmp_path):
    model, opt = _model()
    ckpt = ElasticCheckpointer(model, opt, ctx=_ctx(store, tmp_path))
    ckpt.step_done(1)
    link = StoreLink("127.0.0.1", store.port, "t").connect()
    seq = link.request_checkpoint("budget", by="fleetd")
    ckpt.step_done(2)
    acks = link.acks(seq)
    assert [(a.step, a.rank, a.world_size, a.node_addr) for a in acks] == [(2, 0, 1, "127.0.0.2")]
    assert local_ckpt.newest_complete(tmp_path, "state_dict") == 2
    ckpt.step_done(3)  # a handled request is not answered twice
    assert len(link.acks(seq)) == 1


def test_hold_keeps_the_rank_from_running_ahead_until_released(store, tmp_path):
    model, opt = _model()
    ckpt = ElasticCheckpointer(model, opt, ctx=_ctx(store, tmp_path, hold_timeout_s=30))
    link = StoreLink("127.0.0.1", store.port, "t").connect()
    seq = link.request_checkpoint("spot notice", hold=True, leaving=("127.0.0.3",))
    done = threading.Event()
    worker = threading.Thread(target=lambda: (ckpt.step_done(5), done.set()), daemon=True)
    worker.start()
    for _ in range(100):
        if link.acks(seq):
            break
        time.sleep(0.05)
    assert [a.step for a in link.acks(seq)] == [5]
    assert not done.wait(0.5), "the rank ran ahead of a checkpoint a leave waits on"
    # A second requester (fleetd after the agent) gets the same step without a new save.
    seq2 = link.request_checkpoint("spot notice (fleetd)", hold=True)
    for _ in range(100):
        if link.acks(seq2):
            break
        time.sleep(0.05)
    assert [a.step for a in link.acks(seq2)] == [5]
    store.set(keys.release_key("t", seq2), b"1")
    assert done.wait(10)
    worker.join(5)


def test_hold_gives_up_after_its_timeout(store, tmp_path):
    model, opt = _model()
    ckpt = ElasticCheckpointer(model, opt, ctx=_ctx(store, tmp_path, hold_timeout_s=0.3))
    StoreLink("127.0.0.1", store.port, "t").connect().request_checkpoint("notice", hold=True)
    started = time.monotonic()
    ckpt.step_done(1)
    assert 0.25 < time.monotonic() - started < 5
    assert "hold_timeout" in (tmp_path / "events.jsonl").read_text()


def test_answered_requests_are_not_replayed(store, tmp_path):
    link = StoreLink("127.0.0.1", store.port, "t").connect()
    seq = link.request_checkpoint("old", hold=True)
    link.ack(keys.CheckpointAck(seq=seq, step=7, rank=0, world_size=1, node_addr="127.0.0.9"))
    model, opt = _model()
    ckpt = ElasticCheckpointer(model, opt, ctx=_ctx(store, tmp_path, hold_timeout_s=5))
    started = time.monotonic()
    ckpt.step_done(1)
    assert time.monotonic() - started < 1, "a restarted worker must not hold again for an answered request"


def test_a_request_made_while_workers_restart_is_answered(store, tmp_path):
    # A joining node asks for a hold checkpoint while the survivors' workers are restarting
    # (after a leave): nobody has answered it yet, so the new workers must, or the job loses
    # every step since the last periodic save when the joiner gives up and joins anyway.
    link = StoreLink("127.0.0.1", store.port, "t").connect()
    seq = link.request_checkpoint("127.0.0.9 joins", hold=False)
    model, opt = _model()
    ckpt = ElasticCheckpointer(model, opt, ctx=_ctx(store, tmp_path, hold_timeout_s=5))
    ckpt.step_done(3)
    (ack,) = link.acks(seq)
    assert ack.step == 3 and ckpt.handled_seq == seq


def test_a_stale_unanswered_request_is_not_replayed(store, tmp_path):
    link = StoreLink("127.0.0.1", store.port, "t").connect()
    seq = link.request_checkpoint("old", hold=True)
    old = keys.CheckpointRequest(
        seq=seq, reason="old", hold=True, requested_at=datetime.now(UTC) - timedelta(seconds=60)
    )
    store.set(keys.request_key("t", seq), old.to_bytes())
    model, opt = _model()
    ckpt = ElasticCheckpointer(model, opt, ctx=_ctx(store, tmp_path, hold_timeout_s=5))
    started = time.monotonic()
    ckpt.step_done(1)
    assert time.monotonic() - started < 1, "a request its requester gave up on must not stall training"
    assert link.acks(seq) == []


def test_malformed_request_value_is_ignored(store, tmp_path):
    link = StoreLink("127.0.0.1", store.port, "t").connect()
    store.add(keys.request_seq_key("t"), 1)
    store.set(keys.request_key("t", 1), b"{not json")
    assert link.request(1) is None


@pytest.mark.slow
def test_sharded_dcp_checkpoint_across_two_ranks_resumes(tmp_path):
    """torch.distributed.checkpoint with 2 ranks (torchrun, gloo): save every 4 steps, run again,
    both ranks resume from the newest step."""
    import json
    import subprocess
    import sys

    env = {
        **__import__("os").environ,
        "FLEETD_CKPT_DIR": str(tmp_path / "ckpt"),
        "FLEETD_CKPT_INTERVAL": "4",
        "FLEETD_EVENTS_FILE": str(tmp_path / "ev.jsonl"),
    }

    def run(steps: int) -> None:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                "-m",
                "agent.examples.toy_job.train_toy",
                "--mode",
                "dcp",
                "--steps",
                str(steps),
                "--step-sleep",
                "0",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            start_new_session=True,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    run(9)
    assert local_ckpt.newest_complete(tmp_path / "ckpt", "dcp") == 9  # the final save
    assert sorted(p.name for p in local_ckpt.step_dir(tmp_path / "ckpt", 8).iterdir() if p.suffix == ".distcp")
    run(11)
    events = [json.loads(line) for line in (tmp_path / "ev.jsonl").read_text().splitlines()]
    resumed = [e["from_step"] for e in events if e["ev"] == "resumed"]
    assert resumed == [0, 0, 9, 9]
    assert {e["step"] for e in events if e["ev"] == "done"} == {9, 11}


def test_progress_and_saves_are_reported_on_the_trainer_channel(tmp_path):
    import socket

    from fleetd.protocol.trainer import CheckpointSavedLocally, Progress, parse_report

    path = tmp_path / "trainer.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    try:
        model, opt = _model()
        ckpt = ElasticCheckpointer(
            model, opt, ctx=TrainerContext(ckpt_dir=tmp_path / "c", trainer_socket=path, ckpt_interval=2)
        )
        ckpt.step_done(1)
        ckpt.step_done(2)
        reports = [parse_report(sock.recv(4096)), parse_report(sock.recv(4096))]
    finally:
        sock.close()
    progress = next(r for r in reports if isinstance(r, Progress))
    saved = next(r for r in reports if isinstance(r, CheckpointSavedLocally))
    assert progress.step == 1 and progress.world_size == 1
    assert saved.step == 2 and Path(saved.path) == local_ckpt.step_dir(tmp_path / "c", 2) and saved.nbytes > 0


def test_hold_fails_the_worker_when_the_leaver_is_gone_and_nobody_steers(store, tmp_path, monkeypatch):
    from agent.trainer import elastic

    monkeypatch.setattr(elastic, "LEFT_GRACE_S", 0.2)
    model, opt = _model()
    ckpt = ElasticCheckpointer(model, opt, ctx=_ctx(store, tmp_path, hold_timeout_s=30))
    link = StoreLink("127.0.0.1", store.port, "t").connect()
    link.request_checkpoint("spot notice", hold=True, leaving=("127.0.0.3",))
    link.mark_left("127.0.0.3", keys.Left(exit_code=-9))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="re-forms without them"):
        ckpt.step_done(4)
    assert time.monotonic() - started < 5


def test_a_node_that_is_leaving_itself_never_re_forms_on_its_own(store, tmp_path, monkeypatch):
    """A whole-fleet wave: the first leaver is gone, but this node is noticed too. Re-forming
    would train steps that die with it; it holds until its agent stops it."""
    from agent.trainer import elastic

    monkeypatch.setattr(elastic, "LEFT_GRACE_S", 0.2)
    model, opt = _model()
    ckpt = ElasticCheckpointer(model, opt, ctx=_ctx(store, tmp_path, hold_timeout_s=1.5))
    link = StoreLink("127.0.0.1", store.port, "t").connect()
    link.request_checkpoint("spot notice", hold=True, leaving=("127.0.0.3",))
    link.mark_left("127.0.0.3", keys.Left(exit_code=-9))
    link.request_checkpoint("spot notice", hold=True, leaving=("127.0.0.2",))  # this node's own
    ckpt.step_done(4)  # holds until hold_timeout_s, never raises to re-form
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert "hold_timeout" in {e["ev"] for e in events} and "hold_abandoned" not in {e["ev"] for e in events}
