"""The control host's side of the workers' logs: batches written per node (deduplicated by stream
and sequence number, rotated at a size), bad payloads refused by the intake without harm, and
`fleetd logs` over a state directory: every node interleaved, gone ones too, --node, -n, and
following the files as they grow and rotate."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from fleetd.cli import main
from fleetd.commands.logs import print_lines
from fleetd.intake.mqtt import MqttIntake
from fleetd.intake.registry import NodeRegistry
from fleetd.joblogs.layout import format_line, node_file, node_files, parse_line, rotated
from fleetd.joblogs.reader import LogFollower
from fleetd.joblogs.store import WorkerLogStore, append_batch
from fleetd.protocol.messages import LogLine, WorkerLogs
from fleetd.protocol.topics import node_topic
from fleetd.shared.settings import MqttConfig

T0 = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)


def _batch(
    iid: str, seq: int, first: int, *texts: str, dropped: int = 0, at: float = 0.0, stream: str = "s"
) -> WorkerLogs:
    return WorkerLogs(
        instance_id=iid,
        job="train",
        stream=stream,
        seq=seq,
        first_line=first,
        dropped=dropped,
        lines=tuple(LogLine(text=t, rank=0 if t.startswith("[default0]") else None) for t in texts),
        sent_at=T0 + timedelta(seconds=at),
    )


def _texts(path: Path) -> list[str]:
    return [p.text for line in path.read_text().splitlines() if (p := parse_line(line)) is not None]


# ---------------------------------------------------------------- the writer


async def test_batches_are_written_once_each_in_order(tmp_path: Path) -> None:
    store = WorkerLogStore(tmp_path, job="train")
    writer = asyncio.create_task(store.run())
    try:
        assert store.accept(_batch("i-1", 0, 0, "[default0]:a", "b"))
        assert not store.accept(_batch("i-1", 0, 0, "[default0]:a", "b"))  # a resend
        assert store.accept(_batch("i-1", 1, 2, "c"))
        assert store.accept(_batch("i-1", 0, 0, "new run", stream="s2"))  # the agent restarted
        await store.drain()
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
    path = node_file(tmp_path, "train", "i-1")
    assert _texts(path) == ["[default0]:a", "b", "c", "new run"]
    assert parse_line(path.read_text().splitlines()[0]) is not None
    assert parse_line(path.read_text().splitlines()[0]).rank == 0  # type: ignore[union-attr]
    assert store.duplicates == 1 and store.written == 3


async def test_drops_and_lost_batches_are_said_where_the_lines_were(tmp_path: Path) -> None:
    store = WorkerLogStore(tmp_path)
    writer = asyncio.create_task(store.run())
    try:
        store.accept(_batch("i-1", 0, 0, "a", "b"))
        store.accept(_batch("i-1", 2, 10, "k", dropped=3))  # seq 1 (lines 2-6) never came
        await store.drain()
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
    texts = _texts(node_file(tmp_path, "train", "i-1"))
    assert texts[:2] == ["a", "b"] and texts[-1] == "k"
    assert "5 lines lost on the way here" in texts[2] and "3 lines dropped on the node" in texts[3]


def test_another_jobs_batch_is_refused(tmp_path: Path) -> None:
    store = WorkerLogStore(tmp_path, job="train")
    other = _batch("i-1", 0, 0, "x").model_copy(update={"job": "other"})
    assert not store.accept(other) and store.refused == 1


def test_the_node_file_rotates_and_keeps_n(tmp_path: Path) -> None:
    for seq in range(12):
        append_batch(tmp_path, _batch("i-1", seq, seq, f"line {seq} " + "x" * 60), 0, max_bytes=200, keep=2)
    path = node_file(tmp_path, "train", "i-1")
    files = node_files(tmp_path, "train")["i-1"]
    assert files == [rotated(path, 2), rotated(path, 1), path] and not rotated(path, 3).exists()
    assert all(f.stat().st_size <= 200 for f in files)
    texts = [t for f in files for t in _texts(f)]
    assert texts[-1].startswith("line 11") and texts == sorted(texts, key=lambda t: int(t.split()[1]))


def test_bad_payloads_on_the_logs_channel_are_rejected_not_fatal(tmp_path: Path) -> None:
    got: list[WorkerLogs] = []
    intake = MqttIntake(MqttConfig(), "prod", NodeRegistry(), on_logs=got.append)
    topic = node_topic("prod", "i-1", "logs")
    good = _batch("i-1", 0, 0, "ok")
    bad_job = json.loads(good.to_json())
    bad_job["job"] = "../../etc"
    for payload in (
        b"not json",
        json.dumps(bad_job).encode(),  # a job name that would leave the logs folder
        _batch("i-2", 0, 0, "x").to_json(),  # another node's batch on i-1's topic
        good.to_json().replace(b'"seq":0', b'"seq":-1'),
        b'{"kind": "notice"}',
    ):
        assert intake.handle(topic, payload) is None
    assert intake.rejected == 5 and got == []
    intake.handle(topic, good.to_json())
    assert got == [good]
    # Not an intake event: the registry never sees logs.
    assert intake.accepted == 0


# ---------------------------------------------------------------- reading: fleetd logs


def _write(state: Path, iid: str, *lines: tuple[float, str]) -> None:
    path = node_file(state, "train", iid)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for at, text in lines:
            f.write(format_line(T0 + timedelta(seconds=at), None, text))


def _config(tmp_path: Path, state: Path) -> Path:
    conf = tmp_path / "fleetd.toml"
    conf.write_text(f'[fleet]\nname = "prod"\nstate_dir = "{state}"\n')
    return conf


def test_logs_interleaves_every_node_with_a_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    _write(state, "i-gone", (0, "gone: first"), (2, "gone: third"))  # a terminated node: files only
    _write(state, "i-live", (1, "live: second"), (3, "live: fourth"))
    conf = str(_config(tmp_path, state))
    assert main(["logs", "--config", conf]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln.split(" ", 2)[2] for ln in out] == ["gone: first", "live: second", "gone: third", "live: fourth"]
    assert [ln.split(" ", 1)[0] for ln in out] == ["i-gone", "i-live", "i-gone", "i-live"]
    assert main(["logs", "--config", conf, "--node", "i-gone", "-n", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == ["i-gone 2026-11-26T12:00:02.000Z gone: third"]


def test_logs_without_lines_says_where_it_looked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["logs", "--config", str(_config(tmp_path, tmp_path / "state"))]) == 1
    assert "no lines for job 'train'" in capsys.readouterr().err


def test_follow_prints_new_lines_across_a_rotation(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _write(state, "i-1", (0, "one"))
    follower = LogFollower(state, "train")
    assert [n.line.text for n in follower.poll()] == ["one"]
    assert follower.poll() == []
    _write(state, "i-1", (1, "two"))
    path = node_file(state, "train", "i-1")
    path.rename(rotated(path, 1))  # what the writer's rotation does
    _write(state, "i-1", (2, "three"))
    _write(state, "i-2", (3, "a new node"))
    out = io.StringIO()
    print_lines(follower.poll(), out)
    assert [ln.split(" ", 2)[2] for ln in out.getvalue().splitlines()] == ["two", "three", "a new node"]
    # A line still being written is left for the next poll.
    with open(node_file(state, "train", "i-2"), "a") as f:
        f.write("2026-11-26T12:00:04.000Z - half")
    assert follower.poll() == []
