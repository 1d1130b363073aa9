"""Tell a bug in the job's code from a lost peer while torchrun is still running.

torchrun restarts its workers after any failure, up to ``--max-restarts`` (100), so left alone a
bug would run 100 times, each from the last checkpoint, while the fleet bills. A worker failure in
torchrun's log whose output names no network or process-group fault, and whose exit is not
SIGTERM, is the job's: the agent stops torchrun and reports ``failed``. Pure: the supervisor feeds
it the log's new bytes. (docs/DESIGN.md "Job lifecycle (fleetd/policy/job_state.py, fleetd/job_watch.py)")
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FAILED_LINE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# What a worker's failure says when the fault was another node's or the network's (torch 2.x).
PEER_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "gloo/transport",
    "ProcessGroupGloo",
    "NCCL",
    "DistNetworkError",
    "DistBackendError",
    "DistStoreError",
    "RendezvousConnectionError",
    "RendezvousClosedError",
    "The connection to the C10d store has failed",
    "Socket Timeout",
)
STOPPED_BY_SIGNAL = -15  # SIGTERM: torchrun or fleetd stopping workers, never a failure
# A traceback's last line: "ValueError: bad shape", "[rank1]: RuntimeError: [..gloo..] Connection
# closed by peer", "torch.distributed.DistNetworkError: ...".
# With fleetd's tee (launch.py) every worker line starts with "[<rank>]:" first.
EXCEPTION_LINE = re.compile(
    r"^(?:\[\d+\]:)?(?:\[(?:default)?rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception))\b(.*)$", re.M
)


def is_peer_fault(text: str) -> bool:
    return any(marker in text for marker in PEER_MARKERS)


def names_user_fault(before: str) -> bool:
    """One worker failure's preceding output: the job's own fault unless every exception in it
    is a network one (a rank whose own bug killed the group also shows its peers' broken pipes:
    one non-network exception is enough). No exception at all (an exit code, a SIGKILL): the
    job's, unless the output names a network fault."""
    exceptions = [m.group(0) for m in EXCEPTION_LINE.finditer(before)]
    if exceptions:
        return any(not is_peer_fault(line) for line in exceptions)
    return not is_peer_fault(before)


@dataclass(frozen=True, slots=True)
class UserFailure:
    exit_code: int
    local_rank: int
    excerpt: str  # the end of the failing worker's output, for the job's status


@dataclass
class FailureScanner:
    """Feed it the log's new text; it keeps the part after the last failure line seen (a worker's
    traceback is printed before torchrun's failure line, and may span two reads)."""

    pending: str = ""
    peer_failures: int = 0

    def feed(self, text: str) -> UserFailure | None:
        self.pending += text
        found: UserFailure | None = None
        start = 0
        for m in FAILED_LINE.finditer(self.pending):
            before = self.pending[start : m.start()]
            start = m.end()
            code, rank = int(m.group(1)), int(m.group(2))
            if code == STOPPED_BY_SIGNAL:
                continue
            if not names_user_fault(before):
                self.peer_failures += 1
                continue
            if found is None:
                found = UserFailure(code, rank, before.strip()[-1000:])
        # Keep the tail after the last failure line (bounded: a chatty job must not grow it).
        self.pending = self.pending[start:][-64_000:]
        return found
