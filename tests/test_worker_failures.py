"""Which worker failures in torchrun's log are the job's own (agent/supervise/worker_failures.py).
The samples are torch 2.x output: a rank's traceback, then the elastic agent's failure line."""

from __future__ import annotations

from agent.supervise.worker_failures import FailureScanner, names_user_fault

FAILED = (
    "E1126 16:33:22.258000 16902 torch/distributed/elastic/multiprocessing/api.py:1002] "
    "failed (exitcode: {code}) local_rank: 0 (pid: 16907) of binary: /opt/fleetd/venv/bin/python3\n"
)
USER = """[rank0]: Traceback (most recent call last):
[rank0]:   File "/job/train.py", line 40, in <module>
[rank0]:     loss = model(batch)
[rank0]: ValueError: expected input of shape (64, 32), got (64, 31)
"""
PEER = """[rank1]: Traceback (most recent call last):
[rank1]:   File "/job/train.py", line 44, in <module>
[rank1]:     loss.backward()
[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.1.9]:41321
"""
NCCL = "[rank0]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited\n"


def test_a_traceback_of_the_jobs_own_is_a_user_failure() -> None:
    found = FailureScanner().feed(USER + FAILED.format(code=1))
    assert found is not None and found.exit_code == 1 and found.local_rank == 0
    assert "expected input of shape" in found.excerpt


def test_a_lost_peer_is_not() -> None:
    for text in (PEER, NCCL):
        scanner = FailureScanner()
        assert scanner.feed(text + FAILED.format(code=1)) is None
        assert scanner.peer_failures == 1


def test_a_bug_that_also_broke_a_peers_pipe_is_still_the_jobs() -> None:
    # Rank 0 raised; rank 1 on the same node then saw its collective closed under it.
    assert FailureScanner().feed(USER + PEER + FAILED.format(code=1)) is not None


def test_exit_codes_and_signals() -> None:
    # The OOM killer: no traceback, SIGKILL. The job asked for more memory than the node has.
    oom = FailureScanner().feed("Killed\n" + FAILED.format(code=-9))
    assert oom is not None and oom.exit_code == -9
    # sys.exit(3) with no output.
    assert FailureScanner().feed(FAILED.format(code=3)) is not None
    # SIGTERM: torchrun or fleetd stopping workers (a re-form, a drain): never a failure.
    assert FailureScanner().feed(USER + FAILED.format(code=-15)) is None


def test_a_traceback_split_across_reads_is_judged_whole() -> None:
    scanner = FailureScanner()
    text = PEER + FAILED.format(code=1) + USER + FAILED.format(code=1)
    cut = len(PEER) + len(FAILED.format(code=1)) + 40
    assert scanner.feed(text[:cut]) is None
    found = scanner.feed(text[cut:])
    assert found is not None and "expected input of shape" in found.excerpt
    assert scanner.peer_failures == 1


def test_no_failure_line_no_verdict_and_the_memory_is_bounded() -> None:
    scanner = FailureScanner()
    assert scanner.feed(USER * 5000) is None
    assert len(scanner.pending) <= 64_000


def test_names_user_fault() -> None:
    assert names_user_fault(USER)
    assert not names_user_fault(PEER)
    assert not names_user_fault("The connection to the C10d store has failed")
    assert names_user_fault("")
