"""torchrun's own rendezvous failing is the cloud's fault, never the job's.

A round torch completed with a rank 0 that left as it closed makes its peers wait 60 s for an
address nobody publishes, and then torchrun exits by an exception. Read as "the job's code exited
with 1" that cost the storm demo a job restart (three such and a healthy job FAILS). torchrun_main
exits ``RENDEZVOUS_FAILED_EXIT`` instead, the agent calls it ``rendezvous-failed`` and joins again.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from torch.distributed import TCPStore

from agent.supervise.store_watch import ExitCause, StoreProbe, classify_exit
from agent.supervise.torchrun import TorchrunExit
from agent.supervise.torchrun_main import RENDEZVOUS_FAILED_EXIT

ALIVE = StoreProbe(True, "life-1")


@pytest.mark.parametrize(
    ("exit_", "after", "tail", "want"),
    [
        (TorchrunExit(RENDEZVOUS_FAILED_EXIT, "failed"), ALIVE, "", ExitCause.RENDEZVOUS_FAILED),
        # The failure guard ended it on the job's own exit 75: the job's, whatever the number.
        (TorchrunExit(RENDEZVOUS_FAILED_EXIT, "failed", job_failed=True), ALIVE, "", ExitCause.FAILED),
        (TorchrunExit(1, "failed"), ALIVE, "ValueError: bad shape", ExitCause.FAILED),
        # A store that went away is said first (it explains the rendezvous failing too).
        (TorchrunExit(RENDEZVOUS_FAILED_EXIT, "failed"), StoreProbe(False), "", ExitCause.STORE_LOST),
        (TorchrunExit(RENDEZVOUS_FAILED_EXIT, "failed"), StoreProbe(True, "life-2"), "", ExitCause.STORE_LOST),
    ],
)
def test_a_failed_rendezvous_is_told_from_the_jobs_failure(exit_, after, tail, want) -> None:  # noqa: ANN001
    assert classify_exit(exit_, ALIVE, after, tail) is want


def test_torchrun_exits_75_when_its_own_rendezvous_fails(tmp_path) -> None:  # noqa: ANN001
    """A real torchrun (fleetd's entry point) against a live store whose round never fills: its
    join times out inside torch's rendezvous, before any worker runs."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    marker = tmp_path / "worker-ran"
    cmd = [
        sys.executable,
        "-m",
        "agent.supervise.torchrun_main",
        "--nnodes=2:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{store.port}",
        "--rdzv-id=never-fills",
        "--rdzv-conf=is_host=false,join_timeout=1,last_call_timeout=1",
        "--max-restarts=0",
        "-m",
        "pathlib",  # never reached
        str(marker),
    ]
    env = {"FLEETD_RDZV_POLL_S": "0.1", "FLEETD_JOIN_CKPT_TIMEOUT_S": "1", "PATH": "/usr/bin:/bin"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == RENDEZVOUS_FAILED_EXIT, res.stderr[-3000:]
    assert "RendezvousTimeoutError" in res.stderr and "fleetd: torchrun's rendezvous failed" in res.stderr
    assert not marker.exists()
