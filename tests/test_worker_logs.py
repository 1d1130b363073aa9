"""The node's side of the workers' logs: the batcher (rate cap, drops said in the next batch,
sequence numbers), the journald writer (native protocol, against a datagram socket bound in a tmp
dir), and torchrun's output pipe (the node's bounded file, the sinks, the rank prefix)."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from agent.node.journal import JournalWriter, encode_entry, journal_socket_path
from agent.node.log_batcher import MAX_MESSAGE_BYTES, LogBatcher, LogShipper
from agent.node.log_sink import WorkerLogSink
from agent.supervise.failure_guard import _read_from
from agent.supervise.store_watch import log_tail
from agent.supervise.worker_output import RotatingFile, WorkerOutput, rank_of
from fleetd.protocol.messages import WorkerLogs, parse_message


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _batcher(clock: Clock, **kw: object) -> LogBatcher:
    return LogBatcher(job="train", instance_id="i-1", clock=clock, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- batcher


def test_batches_count_up_and_carry_line_offsets() -> None:
    b = _batcher(Clock())
    assert b.take() == []  # nothing waiting: no empty batch
    for i in range(3):
        assert b.offer(f"line {i}", rank=i % 2)
    first = b.take()
    b.offer("line 3")
    second = b.take()
    assert [m.seq for m in first + second] == [0, 1]
    assert first[0].first_line == 0 and [ln.text for ln in first[0].lines] == ["line 0", "line 1", "line 2"]
    assert [ln.rank for ln in first[0].lines] == [0, 1, 0]
    assert second[0].first_line == 3 and second[0].stream == first[0].stream
    # Each one is a message the controller accepts.
    assert isinstance(parse_message(second[0].to_json()), WorkerLogs)


def test_rate_cap_drops_lines_and_the_next_batch_says_how_many() -> None:
    clock = Clock()
    # 1,000 bytes a second, a bucket of one second: ten 84-byte lines (100 with the overhead) fit.
    b = _batcher(clock, rate_bytes_per_s=1000, burst_s=1.0)
    text = "x" * 84
    accepted = [b.offer(text) for _ in range(15)]
    assert accepted == [True] * 10 + [False] * 5
    batch = b.take()[0]
    assert len(batch.lines) == 10 and batch.dropped == 5 and batch.first_line == 0
    # A second later the bucket has refilled; the drops are said once, not again.
    clock.t = 1.0
    assert b.offer("after")
    nxt = b.take()[0]
    assert nxt.dropped == 0 and nxt.first_line == 15 and nxt.seq == 1
    assert b.dropped_total == 5


def test_drops_alone_still_make_a_batch() -> None:
    clock = Clock()
    b = _batcher(clock, rate_bytes_per_s=10, burst_s=1.0)
    assert not b.offer("far too long for a bucket of ten bytes")
    (batch,) = b.take()
    assert batch.lines == () and batch.dropped == 1 and batch.first_line == 1


def test_pending_is_bounded_while_nothing_is_taken() -> None:
    b = _batcher(Clock(), rate_bytes_per_s=1e9, max_pending_bytes=1000)
    results = [b.offer("y" * 84) for _ in range(20)]
    assert results.count(True) == 10 and b.pending_bytes <= 1000


def test_a_large_batch_is_split_to_fit_a_message() -> None:
    b = _batcher(Clock(), rate_bytes_per_s=1e9, max_pending_bytes=1 << 30, flush_bytes=1 << 30)
    for _ in range(40):
        b.offer("z" * 4000)
    msgs = b.take()
    assert len(msgs) > 1 and all(len(m.to_json()) <= MAX_MESSAGE_BYTES for m in msgs)
    assert [m.seq for m in msgs] == list(range(len(msgs)))
    assert sum(len(m.lines) for m in msgs) == 40
    assert [m.first_line for m in msgs] == [sum(len(p.lines) for p in msgs[:i]) for i in range(len(msgs))]


def test_on_full_fires_at_flush_bytes() -> None:
    fired: list[int] = []
    b = _batcher(Clock(), rate_bytes_per_s=1e9, flush_bytes=500)
    b.on_full = lambda: fired.append(1)
    for _ in range(4):
        b.offer("a" * 100)
    assert not fired
    b.offer("a" * 100)
    assert fired


async def test_shipper_publishes_when_full_and_holds_lines_while_disconnected() -> None:
    sent: list[WorkerLogs] = []
    got = asyncio.Event()
    up = False

    async def publish(m: WorkerLogs) -> None:
        sent.append(m)
        got.set()

    b = _batcher(Clock(), rate_bytes_per_s=1e9, flush_bytes=300)
    shipper = LogShipper(b, publish, lambda: up, interval_s=3600)  # only "full" can wake it
    task = asyncio.create_task(shipper.run())
    await asyncio.sleep(0)
    b.offer("q" * 400)  # full: wakes the shipper, but the broker is away
    for _ in range(5):
        await asyncio.sleep(0)
    assert sent == [] and b.pending_bytes > 0
    up = True
    b.offer("r")
    await asyncio.wait_for(got.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [ln.text[:1] for ln in sent[0].lines] == ["q", "r"]


# ---------------------------------------------------------------- journald


def _decode_entry(data: bytes) -> dict[str, str]:
    out, i = {}, 0
    while i < len(data):
        nl = data.index(b"\n", i)
        head = data[i:nl]
        if b"=" in head:
            k, v = head.split(b"=", 1)
            out[k.decode()] = v.decode()
            i = nl + 1
        else:
            (n,) = struct.unpack("<Q", data[nl + 1 : nl + 9])
            out[head.decode()] = data[nl + 9 : nl + 9 + n].decode()
            i = nl + 9 + n + 1
    return out


@pytest.fixture
def journal_socket(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tmp_path / "journal.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    yield path, sock
    sock.close()


def test_journal_entries_in_the_native_protocol(journal_socket) -> None:  # type: ignore[no-untyped-def]
    path, server = journal_socket
    journal = JournalWriter.open(path)
    assert journal is not None
    sink = WorkerLogSink("train", "i-abc", journal=journal)
    sink.line("[default1]:hello", rank=1)
    sink.line("no rank here")
    first, second = _decode_entry(server.recv(65536)), _decode_entry(server.recv(65536))
    assert first == {
        "MESSAGE": "[default1]:hello",
        "PRIORITY": "6",
        "SYSLOG_IDENTIFIER": "fleetd-job",
        "FLEETD_JOB": "train",
        "FLEETD_NODE": "i-abc",
        "FLEETD_RANK": "1",
    }
    assert "FLEETD_RANK" not in second and second["MESSAGE"] == "no rank here"
    journal.close()


def test_a_value_with_a_newline_is_length_prefixed() -> None:
    data = encode_entry({"MESSAGE": "two\nlines", "A": "b"})
    assert data == b"MESSAGE\n" + struct.pack("<Q", 9) + b"two\nlines\nA=b\n"
    assert _decode_entry(data) == {"MESSAGE": "two\nlines", "A": "b"}
    with pytest.raises(ValueError):
        encode_entry({"_PID": "1"})  # journald's own fields cannot be sent


def test_no_journal_socket_means_no_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert JournalWriter.open(tmp_path / "absent.sock") is None
    monkeypatch.setenv("FLEETD_JOURNAL_SOCKET", "")
    assert journal_socket_path() is None


def test_journald_gone_drops_entries_never_raises(journal_socket) -> None:  # type: ignore[no-untyped-def]
    path, server = journal_socket
    journal = JournalWriter.open(path)
    assert journal is not None
    server.close()
    os.unlink(path)
    assert not journal.send({"MESSAGE": "into the void"}) and journal.dropped == 1


# ---------------------------------------------------------------- torchrun's output pipe


class ListSink(WorkerLogSink):
    def __init__(self) -> None:
        super().__init__("train", "i-1")
        self.got: list[tuple[str, int | None]] = []

    def line(self, text: str, rank: int | None = None) -> None:
        self.got.append((text, rank))


def test_rank_prefixes() -> None:
    assert rank_of("[default3]:loss 0.1") == 3
    assert rank_of("[rank12]: RuntimeError: boom") == 12
    assert rank_of("W1126 torchrun warning") is None


def test_pipe_feeds_file_and_sink_until_every_writer_is_gone(tmp_path: Path) -> None:
    log_path = tmp_path / "torchrun.log"
    sink = ListSink()
    out = WorkerOutput(log_path, sink)
    script = "import sys; print('[default0]:a'); print('[default1]:b'); sys.stderr.write('tail without newline')"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=out.writer(), stderr=subprocess.STDOUT)
    out.close_writer()
    proc.wait()
    assert out.join(10)
    assert sink.got == [("[default0]:a", 0), ("[default1]:b", 1), ("tail without newline", None)]
    assert log_path.read_text() == "[default0]:a\n[default1]:b\ntail without newline"


def test_a_failing_sink_never_stops_the_draining(tmp_path: Path) -> None:
    class Broken(WorkerLogSink):
        def line(self, text: str, rank: int | None = None) -> None:
            raise RuntimeError("sink bug")

    out = WorkerOutput(tmp_path / "t.log", Broken("train", "i-1"))
    proc = subprocess.Popen([sys.executable, "-c", "print('x\\n' * 50000)"], stdout=out.writer())
    out.close_writer()
    assert proc.wait(timeout=30) == 0  # 100 KB: more than a pipe holds, so it was drained
    assert out.join(10) and (tmp_path / "t.log").stat().st_size > 100_000


def test_the_node_file_rotates_and_its_readers_start_over(tmp_path: Path) -> None:
    path = tmp_path / "torchrun.log"
    f = RotatingFile(path, max_bytes=100)
    f.write(b"a" * 80 + b"\n")
    offset = path.stat().st_size  # where the failure guard had read to
    f.write(b"b" * 30 + b"\n")  # would pass 100 bytes: the old file becomes torchrun.log.1
    f.close()
    assert (tmp_path / "torchrun.log.1").read_bytes() == b"a" * 80 + b"\n"
    assert path.read_bytes() == b"b" * 30 + b"\n"
    text, new_offset = _read_from(path, offset)  # past the new file's end: read from its top
    assert text == "b" * 30 + "\n" and new_offset == 31
    assert log_tail(path, since=offset) == "b" * 30 + "\n"


def test_the_tee_prefix_becomes_the_rank_and_leaves_the_text() -> None:
    from agent.supervise.worker_output import split_rank

    assert split_rank("[3]:loss 0.1") == (3, "loss 0.1")
    assert split_rank("[1]:[rank1]: RuntimeError: boom") == (1, "[rank1]: RuntimeError: boom")
    assert split_rank("[rank12]: RuntimeError: boom") == (12, "[rank12]: RuntimeError: boom")
    assert split_rank("W1126 torchrun warning") == (None, "W1126 torchrun warning")


@pytest.mark.slow
def test_real_torchrun_lines_reach_the_sink_with_their_global_rank(tmp_path: Path) -> None:
    """torchrun as the agent starts it (launch.py: --tee, fleetd's prefix template), two ranks on
    one node: every worker line reaches the sink (journald, the control host) with its rank as a
    field and the worker's own text; the node's file keeps the prefixed line."""
    import time
    from dataclasses import replace

    from agent.supervise.torchrun import TorchrunProcess
    from fleetd.rendezvous.localcluster import LocalCluster

    cluster = LocalCluster(tmp_path / "job", run_id="tee-ranks", train_args=("--steps", "100000"))
    sink = ListSink()
    cluster.start_host()
    try:
        spec = replace(cluster.spec("127.0.0.2"), nproc_per_node=2, worker_log_dir=tmp_path / "worker-logs")
        (tmp_path / "worker-logs" / "old-run").mkdir(parents=True)  # a previous torchrun's files
        proc = TorchrunProcess(spec, log_path=tmp_path / "torchrun.log", sink=sink).start()
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                starts = {rank: text for text, rank in list(sink.got) if text.startswith("train_toy: rank")}
                if len(starts) == 2:
                    break
                time.sleep(0.2)
        finally:
            proc.terminate(timeout_s=30)
    finally:
        cluster.close()
    assert sorted(starts) == [0, 1], sink.got[-20:]
    for rank, text in starts.items():
        assert text.startswith(f"train_toy: rank {rank} of 2"), text
    assert "[0]:train_toy: rank 0 of 2" in (tmp_path / "torchrun.log").read_text(errors="replace")
    assert not (tmp_path / "worker-logs" / "old-run").exists(), "earlier torchruns' tee files are removed"
