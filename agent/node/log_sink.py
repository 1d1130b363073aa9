"""Where each line of the workers' output goes besides the node's own file: journald (with the
job, the node and the rank as fields, so ``journalctl FLEETD_JOB=<job> FLEETD_RANK=0`` finds it)
and the batcher that ships it to the control host. Called from the pipe reader's thread; both
sinks are non-blocking."""

from __future__ import annotations

from dataclasses import dataclass

from agent.node.journal import JournalWriter
from agent.node.log_batcher import LogBatcher

SYSLOG_IDENTIFIER = "fleetd-job"
PRIORITY_INFO = 6


@dataclass
class WorkerLogSink:
    job: str
    instance_id: str
    journal: JournalWriter | None = None
    batcher: LogBatcher | None = None

    def line(self, text: str, rank: int | None = None) -> None:
        if self.journal is not None:
            fields: dict[str, str | int] = {
                "MESSAGE": text,
                "PRIORITY": PRIORITY_INFO,
                "SYSLOG_IDENTIFIER": SYSLOG_IDENTIFIER,
                "FLEETD_JOB": self.job,
                "FLEETD_NODE": self.instance_id,
            }
            if rank is not None:
                fields["FLEETD_RANK"] = rank
            self.journal.send(fields)
        if self.batcher is not None:
            self.batcher.offer(text, rank)
