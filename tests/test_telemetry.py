"""Telemetry sampling (no GPU needed) and the local trainer channel (real unix datagram socket)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent.node.telemetry import GpuProbe, TelemetryLoop, sample_telemetry
from agent.node.trainer_channel import TrainerChannel, TrainerProgress
from fleetd.protocol.errors import ProtocolError
from fleetd.protocol.messages import GpuSample, Telemetry
from fleetd.protocol.trainer import CheckpointSavedLocally, Progress, parse_report, send_report


@pytest.fixture
def sock_path():
    with tempfile.TemporaryDirectory(prefix="ft-", dir="/tmp") as d:
        yield Path(d) / "run" / "trainer.sock"


def test_gpu_probe_never_fails() -> None:
    probe = GpuProbe()  # no driver here: unavailable, empty samples; with one: a sample per GPU
    samples = probe.sample()
    assert probe.available == bool(samples)
    assert all(isinstance(s, GpuSample) and 0 <= s.util_pct <= 100 for s in samples)
    probe.close()


def test_sample_has_cpu_memory_and_trainer_progress() -> None:
    t = sample_telemetry("i-0123456789abcdef0", (), TrainerProgress(step=7, steps_per_s=2.5, world_size=3))
    assert 0 <= t.cpu_pct <= 100 and 0 < t.mem_used_pct <= 100
    assert (t.step, t.steps_per_s, t.world_size) == (7, 2.5, 3)
    assert t.gpu_util_pct is None
    gpus = (
        GpuSample(index=0, util_pct=50, mem_used_mib=1, mem_total_mib=2),
        GpuSample(index=1, util_pct=100, mem_used_mib=1, mem_total_mib=2),
    )
    assert sample_telemetry("i-0123456789abcdef0", gpus, TrainerProgress()).gpu_util_pct == 75


async def test_trainer_channel_progress_checkpoint_and_garbage(sock_path: Path) -> None:
    saved: list[CheckpointSavedLocally] = []

    async def on_saved(report: CheckpointSavedLocally) -> None:
        saved.append(report)

    assert not send_report(sock_path, Progress(step=1))  # no agent yet: dropped, no exception
    channel = TrainerChannel(sock_path, on_saved)
    task = asyncio.create_task(channel.run())
    for _ in range(100):
        if sock_path.exists():
            break
        await asyncio.sleep(0.01)
    with capture_logs() as logs:
        assert send_report(sock_path, Progress(step=100, world_size=4))
        await asyncio.sleep(0.2)
        assert send_report(sock_path, Progress(step=120))  # no rate given: the agent computes it
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"\x00garbage", str(sock_path))
            s.sendto(b'{"kind": "progress", "step": -1}', str(sock_path))
            s.sendto(b'{"kind": "progress", "step": 1, "schema_version": 9}', str(sock_path))
        assert send_report(sock_path, CheckpointSavedLocally(step=120, world_size=4, path="/x"))
        for _ in range(100):
            if saved:
                break
            await asyncio.sleep(0.01)
    progress = channel.progress()
    assert progress.step == 120 and progress.world_size == 4
    assert progress.steps_per_s is not None and 20 < progress.steps_per_s < 200  # ~20 steps / 0.2 s
    assert [r.step for r in saved] == [120]
    assert channel.rejected == 3
    assert len([e for e in logs if e["event"] == "trainer_report_rejected"]) == 3
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not sock_path.exists()


def test_parse_report_rejects_oversized_and_unknown() -> None:
    with pytest.raises(ProtocolError):
        parse_report(b"{" + b" " * 5000 + b"}")
    with pytest.raises(ProtocolError):
        parse_report(b'{"kind": "launch-missiles"}')
    assert parse_report(Progress(step=3).model_dump_json().encode()).step == 3


async def test_telemetry_loop_publishes_about_every_interval() -> None:
    published: list[Telemetry] = []

    async def publish(t: Telemetry) -> None:
        published.append(t)

    loop = TelemetryLoop("i-0123456789abcdef0", publish, lambda: TrainerProgress(step=5), interval_s=0.05)
    task = asyncio.create_task(loop.run())
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert 4 <= len(published) <= 11
    assert all(t.step == 5 and t.instance_id == "i-0123456789abcdef0" for t in published)


async def test_unusable_socket_path_does_not_stop_the_agent(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    channel = TrainerChannel(blocker / "trainer.sock")
    await asyncio.wait_for(channel.run(), 5)  # returns (logged), does not raise
    assert channel.progress() == TrainerProgress()
